"""plan_recovery's verdicts and reasons over faked stages, the re-check (preflight.json, SLURM,
--local), apply_plan's writes, and a dry run that writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.config.records import DataSkip
from mscale.errors import MscaleError
from mscale.recover import decide, exclude, stages
from mscale.recover.checkpoints import UNCOMMITTED
from mscale.recover.decide import RecoverOptions, apply_plan, plan_recovery
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, Replan
from mscale.recover.recheck import Rechecker, failure_time, judge_report
from mscale.recover.relaunch import Launch
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan

from tests.conftest import PLANS

NODES = ["node1", "node2", "node3", "node4"]
T_FAIL = 1000.0


def write_events(run, events):
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture
def run(tmp_path):
    """A run directory of the cpu-tiny plan (8 ranks on node[1-4]) whose --local 8 attempt
    stopped at T_FAIL."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run),
            "--local", "8", "--steps", "20"]
    write_events(run, [
        {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
            "launcher": "local", "attempt": 1, "launch": {
                "argv": argv, "cwd": str(tmp_path), "plan": str(run / "plan.yaml"), "local": 8,
                "nodes": NODES, "slurm": None}}},
        {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5], "nodes": ["node3"]}])
    return run


class Fakes:
    """The stages as plain data; each test sets what it needs."""

    def __init__(self, run):
        self.run = run
        self.diagnosis = Diagnosis(cls="gpu", symptom="crash", summary="rank 5 on node3 died",
                                   suspect_ranks=[5], suspect_nodes=["node3"], failed_step=12,
                                   attempt=1)
        self.choice = CheckpointChoice(path=str(run / "ckpt/step-000010"), step=10,
                                       reason="newest that verifies")
        self.exclusions = Exclusions()
        self.replan = None
        self.skip = None
        self.rechecked = None
        self.calls = []

    def install(self, monkeypatch):
        def exclusions(run, diagnosis, recheck=None, plan=None, ran=None, kept=None):
            if recheck is not None:
                self.rechecked = recheck(diagnosis.suspect_nodes)
            return self.exclusions

        def replan(run, plan, exclusions, *, ran=None, allow_batch_change=False, write=True):
            self.calls.append(("replan", write, allow_batch_change))
            if isinstance(self.replan, Exception):
                raise self.replan
            return self.replan

        monkeypatch.setattr(stages, "diagnose", lambda run_dir: self.diagnosis)
        monkeypatch.setattr(stages, "choose_checkpoint", lambda run, d, verify="quick":
                            self.choice)
        monkeypatch.setattr(stages, "decide_exclusions", exclusions)
        monkeypatch.setattr(stages, "replan", replan)
        monkeypatch.setattr(stages, "data_skip_for", lambda d, c, skips=None: self.skip)
        monkeypatch.setattr(stages, "record_data_skip",
                            lambda run, skip: self.calls.append(("skip", skip.skip_steps)))
        monkeypatch.setattr(stages, "pin_checkpoint",
                            lambda run, path, reason: self.calls.append(("pin", path)))
        return self


@pytest.fixture
def fakes(run, monkeypatch):
    return Fakes(run).install(monkeypatch)


def shrunk(run) -> Replan:
    return Replan(plan_path=str(run / "recover/plan-0001.yaml"), nodes=["node1", "node2"],
                  world=4, layout="tp2 pp2 dp1 on 2 nodes (cpu-4x2)",
                  old_layout="tp2 pp2 dp2 on 4 nodes (cpu-4x2)", old_step_time_s=1.0,
                  new_step_time_s=1.8, global_batch=16, unused_nodes=["node4"],
                  note="DP 2 -> 1, 2x more micro-batches")


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


# --- re-checking suspect nodes -------------------------------------------------------------

def report(t, bad=("node3",)) -> PreflightReport:
    results = [CheckResult(check="gemm", entity_kind="rank", entity=f"rank {r}",
                           node=NODES[r // 2], value=1.0, status="OK") for r in range(8)]
    results[5] = CheckResult(check="gemm", entity_kind="rank", entity="rank 5", node="node3",
                             value=0.2, status="CRITICAL", message="0.2x the median")
    return PreflightReport(time=t, world=8, layout={"tp": 2, "pp": 2, "dp": 2},
                           results=results, bad_nodes=list(bad))


def checker(run, launch, srun=None) -> Rechecker:
    plan = load_checked_plan(str(run / "plan.yaml"))
    kw = {"srun": srun} if srun else {}
    return Rechecker(RunDir(str(run)), plan, str(run / "plan.yaml"), launch,
                     since=failure_time(RunDir(str(run))), **kw)


def test_the_failure_time_skips_a_bad_events_line(run):
    """Read as the diagnosis reads the files (their tails, a bad line skipped): a line that is
    not JSON stopped recover's re-check with exit 3."""
    with open(run / "events.jsonl", "a") as f:
        f.write("NOT JSON\n")
    assert failure_time(RunDir(str(run))) == T_FAIL


def test_a_preflight_report_newer_than_the_failure_answers(run):
    assert failure_time(RunDir(str(run))) == T_FAIL
    (run / "preflight.json").write_text(report(T_FAIL + 5).model_dump_json())
    got = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))(["node3", "node2"])
    assert got["node2"] is None and "gemm: 0.2x the median" in got["node3"]
    (run / "preflight.json").write_text(report(T_FAIL - 5).model_dump_json())  # before: ignored
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {} and "not re-checked" in c.notes[0]


def test_a_damaged_preflight_report_is_said_not_passed_over(run):
    (run / "preflight.json").write_text('{"time": "yesterday"}')
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {}
    assert "is not a preflight report, not used" in c.notes[0], c.notes


def test_a_preflight_report_without_a_time_does_not_answer(run):
    """Read as it is, the model would give it the time of reading: newer than any failure."""
    doc = json.loads(report(T_FAIL + 5).model_dump_json())
    del doc["time"]
    (run / "preflight.json").write_text(json.dumps(doc))
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {} and "not re-checked" in c.notes[0]


def test_a_report_says_nothing_of_a_node_it_never_measured():
    """bad_nodes also lists quarantine.json's nodes outside the job: no verdict of preflight's."""
    assert judge_report(report(T_FAIL + 5, bad=("node3", "node9")), ["node3", "node9"]) == {
        "node3": "preflight re-check failed (gemm: 0.2x the median)"}


def test_a_stale_preflight_is_said_in_the_report_and_the_json(run, fakes, monkeypatch):
    """An operator must see why a node preflight.json names bad is not kept out."""
    from mscale.recover.report import render

    monkeypatch.setattr(stages, "decide_exclusions", exclude.decide_exclusions)
    fakes.diagnosis.cls, fakes.diagnosis.suspect_nodes = "software", []
    (run / "preflight.json").write_text(report(T_FAIL - 2 * 86_400).model_dump_json())
    plan = plan_recovery(str(run), RecoverOptions(recheck=False))
    note = ("preflight.json from 1969-12-30 00:16 UTC predates attempt 1 (started 1970-01-01 "
            "00:15 UTC): its bad nodes (node3) are not used")
    assert plan.exclusions.nodes == [] and note in plan.reasons
    assert plan.to_json()["exclusions"]["notes"] == [note]
    assert f"  - {note}\n" in render(plan, executed=False, decision=None)


def test_slurm_re_check_runs_preflight_on_the_jobs_nodes(run):
    seen = []

    def srun(argv, timeout):
        if argv[0] == "sinfo":
            return 0, "".join(f"{n} idle\n" for n in NODES), ""
        seen.append(argv)
        return 2, "rank 0 says hi\n" + report(time.time()).model_dump_json(), ""

    launch = Launch(argv=["/venv/bin/mscale", "train"], nodes=NODES, launcher="slurm",
                    slurm={"job_id": "7", "job_name": "j", "nodelist": "node[1-4]", "nnodes": 4})
    got = checker(run, launch, srun)(["node3"])
    assert "preflight re-check failed" in got["node3"]
    argv = seen[0]
    assert argv[:7] == ["srun", "--job-name=j-recheck", "--nodelist=node[1-4]", "--nodes=4",
                        "--ntasks=8", "--ntasks-per-node=2", "--immediate=60"]
    assert argv[7:10] == ["/venv/bin/mscale", "preflight", str(run / "plan.yaml")]


def test_a_slurm_re_check_says_a_line_before_and_after_on_stderr_only(run, capsys):
    """A re-check takes seconds to minutes: silence looks like a hang. stdout stays --json's."""
    def srun(argv, timeout):
        if argv[0] == "sinfo":
            return 0, "".join(f"{n} idle\n" for n in NODES), ""
        return 0, report(time.time()).model_dump_json(), ""

    launch = Launch(argv=["mscale"], nodes=NODES, launcher="slurm", slurm={"job_id": "7"})
    c = checker(run, launch, srun)
    c(["node3"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2, err
    assert lines[0].startswith("recover: re-checking node3 with preflight (up to 340 s)")
    assert lines[1].startswith("recover: re-check of node3 done in ") and "node3: preflight " \
        "re-check failed" in lines[1]


def test_a_local_run_is_not_re_checked_and_says_nothing(run, capsys):
    checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))(["node3"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("state, excluded", [("drained", True), ("idle*", True), ("idle", False)])
def test_a_slurm_re_check_blames_a_node_only_on_a_report_or_slurms_word(run, state, excluded):
    calls = []

    def srun(argv, timeout):
        calls.append(argv[0])
        if argv[0] == "sinfo":
            return 0, f"node3 {state}\n", ""
        return 1, "", "srun: error: node1: task 1: Exited with exit code 3\n"

    launch = Launch(argv=["mscale"], nodes=NODES, launcher="slurm", slurm={"job_id": "7"})
    c = checker(run, launch, srun)
    got = c(["node3"])
    if excluded:  # known before any srun: no minute spent waiting for a node that is down
        assert got == {"node3": f"preflight could not run on it: SLURM reports it {state}"}
        assert calls == ["sinfo"]
    else:
        assert got == {} and "the preflight job failed (srun exit 1: srun: error: node1" \
            in c.notes[0]


def test_run_plan_falls_back_to_the_recorded_plan(run, fakes):
    moved = run.parent / "elsewhere.yaml"
    shutil.move(run / "plan.yaml", moved)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    events[0]["evidence"]["launch"]["plan"] = str(moved)
    write_events(run, events)
    plan, url = decide._run_plan(RunDir(str(run)), decide.recorded_launch(RunDir(str(run))))
    assert url == str(moved) and plan.layout.world_size == 8


def test_a_suspect_re_checked_healthy_is_said_to_be_kept(run, fakes):
    (run / "preflight.json").write_text(report(T_FAIL + 5, bad=()).model_dump_json())
    fakes.diagnosis.suspect_nodes = ["node2"]
    plan = plan_recovery(str(run))
    assert fakes.rechecked == {"node2": None}
    assert "node2 re-checked healthy by preflight: kept" in plan.reasons


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


def srun_command(run, exclude: str) -> list[str]:
    """supervise's CMD inside an allocation: the user's own srun -x."""
    return ["srun", "-x", exclude, "-N4", "-n8", "/venv/bin/mscale", "train",
            str(run / "plan.yaml"), "--run-dir", str(run)]


@pytest.fixture
def real_replan(fakes, monkeypatch):
    """The stages' own re-plan over the faked diagnosis: what it counts is the point."""
    from mscale.recover import replan

    monkeypatch.setattr(stages, "replan", replan.replan)
    fakes.diagnosis.cls, fakes.diagnosis.suspect_nodes = "software", []
    return fakes


def test_a_node_the_jobs_own_srun_keeps_out_is_not_counted_by_the_re_plan(run, real_replan):
    """The attempt ran on node[1-4]; the command now keeps node4 out: re-planned for the nodes
    left, the relaunch asks for no more nodes than srun may give it (it asked for 4 of 3)."""
    from mscale.recover.report import render

    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node4")))
    assert plan.exclusions.nodes == [] and list(plan.exclusions.carried) == ["node4"]
    assert plan.replan is not None and "node4" not in plan.replan.nodes
    assert f"--nodes={len(plan.replan.nodes)}" in plan.command
    assert "--exclude=node4" in plan.command and plan.verdict == "degraded"
    text = render(plan, executed=False, decision=None)
    assert "exclusions: none by this recovery\n" in text
    assert ("  node4: kept out by the job's own command (its -x/--exclude) before this "
            "recovery\n") in text
    assert any(r.startswith("1 node(s) kept out: node4 (node4: kept out by the job's own")
               for r in plan.reasons)


def test_a_jobs_exclusion_that_costs_the_relaunch_no_node_changes_nothing(run, real_replan):
    """node9: not among the attempt's nodes (nor the plan's); node4: its quarantine expired,
    so the relaunch lets it back. Either way the job relaunches as it was."""
    from mscale.config.records import Quarantine, QuarantineEntry

    q = Quarantine(entries=[QuarantineEntry(node="node4", reason="hot", expires=1.0)])
    (run / "quarantine.json").write_text(q.model_dump_json())
    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node[4,9]")))
    assert plan.exclusions.carried == {} and plan.replan is None
    assert plan.verdict == "relaunchable" and "--exclude=node9" in plan.command


def test_too_few_nodes_left_with_the_jobs_own_exclusions_is_refused_naming_them(run, fakes,
                                                                                monkeypatch):
    from mscale.recover import replan

    monkeypatch.setattr(stages, "replan", replan.replan)
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "diagnosis: gpu"})
    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node[1-2,4]")))
    assert plan.verdict == "unrecoverable" and plan.command == []
    assert "every node of the plan is excluded (node[1-4])" in plan.reasons[0]


def test_the_slurm_jobs_excluded_nodes_are_asked_of_scontrol_once(run, real_replan,
                                                                    monkeypatch):
    """The recorded job's ExcNodeList (an operator's `scontrol update` since) counts in the
    re-plan, and the relaunch uses the same answer instead of asking again."""
    from mscale.recover import relaunch

    asked = []

    def scontrol(argv):
        asked.append(argv)
        return 0, ("JobId=7 JobState=FAILED BatchFlag=1 Command=/nonexistent/job.sh "
                   "ExcNodeList=node2 Partition=debug")

    monkeypatch.setattr(relaunch, "run_quiet", scontrol)
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run)]
    write_events(run, [
        {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
            "launcher": "slurm", "attempt": 1, "launch": {
                "argv": argv, "cwd": str(run.parent), "plan": str(run / "plan.yaml"),
                "local": 0, "nodes": NODES, "slurm": {"job_id": "7", "job_name": "j",
                                                      "nodelist": "node[1-4]", "nnodes": 4}}}},
        {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5], "nodes": ["node3"]}])
    plan = plan_recovery(str(run), RecoverOptions(recheck=False))
    assert len(asked) == 1 and plan.exclusions.carried == {
        "node2": "kept out of the job's allocation before this recovery (scontrol's "
                 "ExcNodeList)"}
    assert "node2" not in plan.replan.nodes and plan.command[0] == "sbatch"
    assert f"--nodes={len(plan.replan.nodes)}" in plan.command
    assert "--exclude=node2" in plan.command
