"""plan_recovery's verdicts and reasons over faked stages (decide_fakes.py), room after a full
disk, apply_plan's writes, and a dry run that writes nothing. The re-check of suspect nodes:
test_recheck.py; the nodes the job itself keeps out: test_decide_own_exclusions.py; SLURM with the
real stages: test_decide_slurm.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mscale.config.records import DataSkip
from mscale.errors import MscaleError
from mscale.recover import decide
from mscale.recover.checkpoints import UNCOMMITTED
from mscale.recover.decide import RecoverOptions, apply_plan, plan_recovery
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, Replan
from mscale.runs.rundir import RunDir

from tests.unit.recover.decide_fakes import (NODES, fakes, run,  # noqa: F401 - fixtures
                                             shrunk, write_events)


def test_a_transient_crash_is_relaunched_as_it_was(run, fakes):
    fakes.diagnosis.suspect_nodes, fakes.diagnosis.transient = [], True
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and plan.exit_code == 0 and plan.launcher == "local"
    assert plan.command[-4:] == ["--local", "8", "--steps", "20"]
    assert plan.reasons == ["relaunch as before, from step 10"]
    assert plan.cwd == str(run.parent)  # the job's own directory, where --execute runs it


def test_a_full_disk_is_relaunched_with_a_word_to_free_space(run, fakes):
    fakes.diagnosis.cls, fakes.diagnosis.symptom = "storage", "disk_full"
    fakes.diagnosis.suspect_nodes = []
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and "free space" in plan.reasons[-1]


def test_a_storage_failure_names_the_filesystem_to_check_and_keeps_every_node(run, fakes):
    fakes.diagnosis.cls, fakes.diagnosis.symptom = "storage", "crash"
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and plan.exclusions.nodes == []
    assert any("check the filesystem of the run directory" in r for r in plan.reasons)


def test_a_data_store_down_names_the_store_not_the_run_directorys_filesystem(run, fakes):
    fakes.diagnosis.cls, fakes.diagnosis.symptom = "storage", "crash"
    fakes.diagnosis.rule = "data_store_down"
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and plan.exclusions.nodes == []
    assert any("remote data store stopped answering" in r for r in plan.reasons)
    assert not any("check the filesystem of the run directory" in r for r in plan.reasons)


def committed(run, step: int, size: int = 5000) -> None:
    """A checkpoint directory of ``size`` bytes with a commit marker (what retention counts)."""
    ckpt = run / f"ckpt/step-{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "rank-00000.bin").write_bytes(b"x" * size)
    (ckpt / "COMMITTED").write_text("{}")


def test_a_full_disk_still_full_is_refused_saying_how_much_to_free(run, fakes, monkeypatch):
    """Relaunched into the same full filesystem, the job would fail at its next save (and a
    supervisor would relaunch it again): refused until there is room for one checkpoint, when
    the run holds --ckpt-keep (3) of them already."""
    fakes.diagnosis.cls, fakes.diagnosis.symptom = "storage", "disk_full"
    fakes.diagnosis.suspect_nodes = []
    for step in (6, 8, 10):
        committed(run, step, size=5000 if step == 10 else 10)
    usage = shutil.disk_usage(run)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    plan = plan_recovery(str(run))
    assert plan.verdict == "unrecoverable" and plan.command == []
    [why] = [r for r in plan.reasons if "still full" in r]
    assert "1.0 KB free" in why and "free at least 4.0 KB" in why and "run recover again" in why
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**9))
    assert plan_recovery(str(run)).verdict == "relaunchable"


def test_room_counts_the_saves_before_retention_deletes_one(run, fakes, monkeypatch):
    """Old checkpoints deleted to make room: with one committed checkpoint left and --ckpt-keep
    3, the relaunch writes three more before retention deletes any, so room for one is not
    enough (a user trial's relaunch met the full disk again at its second save). The job's own
    --ckpt-keep counts, and a checkpoint pinned by hand is never deleted, so it counts not."""
    fakes.diagnosis.cls, fakes.diagnosis.symptom = "storage", "disk_full"
    fakes.diagnosis.suspect_nodes = []
    committed(run, 10)
    usage = shutil.disk_usage(run)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=6000))
    plan = plan_recovery(str(run))
    [why] = [r for r in plan.reasons if "still full" in r]
    assert "writes 3 checkpoints of 5.0 KB" in why and "--ckpt-keep 3" in why
    assert "free at least 9.0 KB" in why and plan.verdict == "unrecoverable"
    committed(run, 8)
    committed(run, 6)
    assert plan_recovery(str(run)).verdict == "relaunchable"  # 3 kept: one save, then a deletion
    (run / "ckpt/step-000006/KEEP").write_text('{"reason": "the paper figure", "who": "me"}')
    [why] = [r for r in plan_recovery(str(run)).reasons if "still full" in r]
    assert "writes 2 checkpoints" in why
    own = ["mscale", "train", "plan.yaml", "--run-dir", str(run), "--ckpt-keep", "1"]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2000))
    [why] = [r for r in plan_recovery(str(run), RecoverOptions(command=own)).reasons
             if "still full" in r]
    assert "one checkpoint takes 5.0 KB" in why


def test_a_moved_run_is_relaunched_into_itself_not_where_it_was_started(run, fakes, tmp_path):
    """The job was started as ``--run-dir old/run`` from another directory, then the run was
    moved: the relaunch names the directory recover diagnosed, absolute, or it would train a
    fresh run in the old place."""
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    launch = events[0]["evidence"]["launch"]
    launch["argv"][launch["argv"].index("--run-dir") + 1] = "old/run"
    launch["cwd"] = str(tmp_path / "gone")
    write_events(run, events)
    fakes.diagnosis.suspect_nodes, fakes.diagnosis.transient = [], True
    plan = plan_recovery(os.path.relpath(run))
    assert plan.command[plan.command.index("--run-dir") + 1] == str(run)


def test_excluded_node_re_planned_is_degraded_with_every_reason(run, fakes):
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "SIGKILL on rank 5"})
    fakes.replan = shrunk(run)
    plan = plan_recovery(str(run))
    assert plan.verdict == "degraded" and plan.exit_code == 1
    assert plan.command[2] == str(run / "recover/plan-0001.yaml")
    assert plan.command[plan.command.index("--local") + 1] == "4"
    text = " | ".join(plan.reasons)
    assert "node3: SIGKILL on rank 5" in text and "tp2 pp2 dp1" in text
    assert "left idle: node4" in text
    assert "node3 not re-checked: under --local every node is this machine" in text
    assert fakes.rechecked == {} and fakes.calls == [("replan", False, False)]


def test_a_finished_run_exits_0_with_no_re_check_re_plan_or_command(run, fakes):
    """A quarantine entry left from the run would re-plan a relaunch; a finished run needs
    none: exit 0 (not 1, degraded), no re-plan file named, nothing re-checked."""
    from mscale.recover.report import render

    fakes.diagnosis = Diagnosis(cls="none", symptom="finished", summary="The run finished",
                                failed_step=20, attempt=1, exit_code=0)
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "quarantined"})
    fakes.replan = shrunk(run)
    fakes.skip = DataSkip(after_step=10, skip_steps=2, reason="x")
    plan = plan_recovery(str(run))
    assert (plan.verdict, plan.exit_code, plan.command, plan.replan, plan.data_skip) == \
        ("finished", 0, [], None, None)
    assert plan.reasons == ["the run finished: nothing to recover"]
    assert fakes.rechecked is None and fakes.calls == []
    text = render(plan, executed=False, decision=None)
    assert "FINISHED, nothing to recover (exit 0)" in text
    assert "re-plan" not in text and "plan-0" not in text


def test_a_changed_batch_is_relaunched_with_trains_permission(run, fakes):
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "SIGKILL on rank 5"})
    fakes.replan = shrunk(run)
    fakes.replan.global_batch, fakes.replan.batch_changed = 12, True
    plan = plan_recovery(str(run), RecoverOptions(allow_batch_change=True))
    assert plan.command[-1] == "--allow-batch-change" and plan.verdict == "degraded"
    assert "global batch changed to 12 (--allow-batch-change)" in " | ".join(plan.reasons)
    assert fakes.calls == [("replan", False, True)]
    fakes.replan.batch_changed = False
    assert "--allow-batch-change" not in plan_recovery(str(run)).command


def test_rollback_with_data_skip_resumes_from_the_older_checkpoint(run, fakes):
    fakes.diagnosis = Diagnosis(cls="numerics", symptom="divergence", summary="loss diverged",
                                failed_step=14, bad_step=12)
    fakes.choice = CheckpointChoice(path=str(run / "ckpt/step-000010"), step=10, reason="before",
                                    is_latest=False, rollback=True,
                                    rejected=[{"name": "step-000012", "why": "at the bad step"}])
    fakes.skip = DataSkip(after_step=10, skip_steps=2, reason="divergence at 12")
    plan = plan_recovery(str(run))
    assert plan.verdict == "degraded" and plan.data_skip["skip_steps"] == 2
    assert plan.data_skip["global_batch"] == 16  # the batch of the steps skipped (cpu-tiny)
    assert plan.command[-2:] == ["--resume", str(run / "ckpt/step-000010")]
    assert any("passing over step-000012 (at the bad step)" in r for r in plan.reasons)


@pytest.mark.parametrize("case", ["bad_input", "no_checkpoint", "no_layout"])
def test_unrecoverable_cases_have_no_command_and_say_why(run, fakes, case):
    if case == "bad_input":
        fakes.diagnosis = Diagnosis(cls="user_code", symptom="bad_input", summary="bad config")
        why = "fix the code or input, then start the job again: "  # its command, not recover
    elif case == "no_checkpoint":
        fakes.choice = CheckpointChoice(path=None, step=None, reason="none committed")
        why = "had reached step 12"
    else:
        fakes.exclusions = Exclusions(nodes=NODES, reasons={n: "dead" for n in NODES})
        fakes.replan = MscaleError("no node left")
        why = "no layout fits the remaining nodes: no node left"
    plan = plan_recovery(str(run))
    assert plan.verdict == "unrecoverable" and plan.exit_code == 2 and plan.command == []
    assert any(why in r for r in plan.reasons)
    if case == "bad_input":  # the operator is given the job's own command to run once fixed
        assert any(why in r and "--local 8 --steps 20" in r for r in plan.reasons), plan.reasons
        fakes.exclusions = Exclusions(nodes=["node3", "node4"], reasons={
            "node3": "quarantined", "node4": "quarantined"})
        fakes.replan = shrunk(run)
        plan = plan_recovery(str(run))  # not this recovery's rewrite (a re-plan never written)
        said = next(r for r in plan.reasons if why in r)
        assert "--local 8 --steps 20" in said and "recover/plan-" not in said, said


def test_an_operators_stop_without_a_checkpoint_starts_over_degraded(run, fakes):
    """A second Ctrl-C chose to lose the steps ("without a checkpoint"): not a human's call
    still to make, as it is after a failure (exit 2 above), but a relaunch that trains them
    again (exit 1)."""
    fakes.diagnosis = Diagnosis(cls="none", symptom="stopped", summary="the operator "
                                "interrupted the job", failed_step=7, exit_code=130)
    fakes.choice = CheckpointChoice(path=None, step=None, reason="none committed")
    fakes.exclusions = Exclusions()
    plan = plan_recovery(str(run))
    assert plan.verdict == "degraded" and plan.exit_code == 1 and plan.command
    assert "the stop saved no checkpoint: steps 1-7 are trained again, from step 0" in \
        plan.reasons
    fakes.diagnosis.exit_code = None  # a scancel whose grace ran out: nobody chose the loss
    plan = plan_recovery(str(run))
    assert plan.verdict == "unrecoverable"
    assert any("human's call (the job's own command with --resume none)" in r
               for r in plan.reasons), plan.reasons


def test_a_second_ctrl_c_during_the_first_save_starts_over_degraded(run, fakes):
    """The Ctrl-C cut the run's first save short: its directory is left uncommitted (never a
    checkpoint, train.md), so passing it over loses nothing the operator did not choose to lose;
    a committed checkpoint passed over (damaged) still makes it a human's call."""
    fakes.diagnosis = Diagnosis(cls="none", symptom="stopped", summary="the operator "
                                "interrupted the job", failed_step=6, exit_code=130)
    fakes.choice = CheckpointChoice(path=None, step=None, reason="none of the 1 is usable",
                                    rejected=[{"name": "step-000003", "why": UNCOMMITTED}])
    fakes.exclusions = Exclusions()
    plan = plan_recovery(str(run))
    assert plan.verdict == "degraded" and plan.exit_code == 1 and plan.command
    fakes.choice.rejected.append({"name": "step-000002", "why": "failed quick verify: x"})
    plan = plan_recovery(str(run))
    assert plan.verdict == "unrecoverable"
    # train refuses --resume none on a run holding a committed checkpoint, damaged or not
    assert any("human's call (train it in a new --run-dir: --resume none is refused" in r
               for r in plan.reasons), plan.reasons


def test_nothing_to_lose_without_a_checkpoint_starts_over(run, fakes):
    fakes.diagnosis.failed_step, fakes.diagnosis.suspect_nodes = 0, []
    fakes.choice = CheckpointChoice(path=None, step=None, reason="none yet")
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and "step 0" in plan.reasons[0]


def tree(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): os.path.getmtime(os.path.join(d, f))
            for d, _, files in os.walk(root) for f in files}


def test_dry_run_writes_nothing_apply_writes_decision_event_skip_and_pin(run, fakes):
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "dead"})
    fakes.replan = shrunk(run)
    fakes.choice.is_latest, fakes.choice.rollback = False, True
    fakes.skip = DataSkip(after_step=10, skip_steps=1)
    before = tree(run)
    plan = plan_recovery(str(run))
    assert tree(run) == before
    url = apply_plan(plan)
    assert url.endswith("recover/decision-0001.json")
    doc = json.loads(open(url).read())
    assert doc["verdict"] == "degraded" and doc["exit_code"] == 1
    assert fakes.calls[1:] == [("replan", True, False), ("skip", 1),
                               ("pin", str(run / "ckpt/step-000010"))]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["source"] == "recover" and events[-1]["kind"] == "recover"
    assert events[-1]["severity"] == "warning" and events[-1]["nodes"] == ["node3"]
    assert events[-1]["evidence"]["decision"] == "decision-0001.json"
    assert apply_plan(plan).endswith("decision-0002.json")


def test_apply_refuses_a_re_plan_that_changed_since_the_dry_run(run, fakes):
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "dead"})
    fakes.replan = shrunk(run)
    plan = plan_recovery(str(run))
    fakes.replan = Replan(**{**shrunk(run).to_json(), "layout": "tp1 pp2 dp2"})
    with pytest.raises(MscaleError, match="changed since the dry run"):
        apply_plan(plan)


def test_unrecoverable_apply_writes_only_the_decision(run, fakes):
    fakes.diagnosis = Diagnosis(cls="user_code", symptom="bad_input", summary="bad config")
    plan = plan_recovery(str(run))
    apply_plan(plan)
    assert fakes.calls == [("replan", False, False)]
    assert (run / "recover/decision-0001.json").exists()


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_not_a_run_directory_is_bad_input(tmp_path, where):
    path = tmp_path / "x"
    if where == "empty":
        path.mkdir()
    with pytest.raises(MscaleError) as e:
        plan_recovery(str(path))
    assert e.value.code == 3


def test_run_plan_falls_back_to_the_recorded_plan(run, fakes):
    moved = run.parent / "elsewhere.yaml"
    shutil.move(run / "plan.yaml", moved)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    events[0]["evidence"]["launch"]["plan"] = str(moved)
    write_events(run, events)
    plan, url = decide._run_plan(RunDir(str(run)), decide.recorded_launch(RunDir(str(run))))
    assert url == str(moved) and plan.layout.world_size == 8


def test_a_job_that_failed_before_recording_its_plan_is_told_why_not_only_that(tmp_path):
    """A launch refused at its start (a layout for 8 processes started on 1) leaves an error
    file and no plan.yaml: recover names the cause, and that there is nothing to recover."""
    from tests.unit.recover.diag_runs import Run

    run = Run(tmp_path / "run")
    (tmp_path / "run" / "plan.yaml").unlink()
    line = "layout: the launcher started 1 processes but the plan needs 8"
    run.error_file(0, 1.0, "bad_input", f"{line}; fix: launch exactly 8 processes")
    run.event("stop", 1.0, severity="critical", ranks=[0], nodes=["node1"],  # rank 0's own
              message=f"error (rank 0 on node1, bad_input): {line}",
              evidence={"kind": "bad_input", "error_file": "logs/rank0.error.json"})
    with pytest.raises(MscaleError) as e:
        plan_recovery(run.path, RecoverOptions(recheck=False))
    assert "the job stopped before it started training" in e.value.message
    assert "the launcher started 1 processes but the plan needs 8" in e.value.message
    assert "nothing to recover" in e.value.fix
