"""relaunch.py: the relaunch command from the recorded launch (the last train start, a damaged
record sanitised) or a given one; SLURM's requeue, batch script and --wrap paths; torchrun. The
argv rewrite itself: test_command.py."""

from __future__ import annotations

import json
import shlex

import pytest

from mscale.errors import MscaleError
from mscale.recover.command import Change
from mscale.recover.relaunch import Launch, recorded_launch, relaunch
from mscale.runs.rundir import RunDir

from tests.unit.recover.launch_commands import MSCALE, NODES, shrink


def slurm_launch(job_id="42") -> Launch:
    return Launch(argv=[MSCALE, "train", "/abs/plan.yaml", "--run-dir", "/abs/run"],
                  cwd="/abs", plan="/abs/plan.yaml", nodes=NODES, launcher="slurm",
                  slurm={"job_id": job_id, "job_name": "mscale-e2e", "nodelist": "node[1-4]",
                         "nnodes": 4})


def scontrol(fields: dict | None):
    calls = []

    def run(cmd):
        calls.append(cmd)
        if fields is None:
            return 1, ""
        return 0, " ".join(f"{k}={v}" for k, v in fields.items()) + "\n"
    run.calls = calls
    return run


def test_slurm_requeues_a_batch_job_when_nothing_changes():
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh"})
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert out.command == ["scontrol", "requeue", "42"] and out.launcher == "slurm"
    assert run.calls == [["scontrol", "show", "job", "-o", "42"]]


def test_a_job_slurm_queued_again_itself_is_left_to_run():
    """A node failure requeues a --requeue batch job before recover runs: `scontrol requeue` of
    a pending job fails, and a new submission would train twice into one run directory."""
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "PENDING", "Restarts": "1"})
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert out.command == [] and "queued job 42 again" in out.notes[0]
    assert "JobState=PENDING, Restarts=1" in out.notes[0]


def test_a_queued_again_job_is_told_to_keep_off_the_excluded_node():
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "PENDING", "Restarts": "1", "ExcNodeList": "node7"})
    change = Change(world=8, nodes=["node1", "node2", "node4", "node5"], excluded=["node3"])
    out = relaunch(slurm_launch(), change, 2, run=run)
    assert out.command == ["scontrol", "update", "JobId=42", "ExcNodeList=node[3,7]"]


def test_a_node_back_in_the_pool_leaves_the_jobs_exclusions():
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "PENDING", "Restarts": "1", "ExcNodeList": "node[7,9]"})
    change = Change(world=8, nodes=["node1", "node2", "node4", "node5"], excluded=["node3"],
                    released=["node9"])  # its quarantine expired
    out = relaunch(slurm_launch(), change, 2, run=run)
    assert out.command == ["scontrol", "update", "JobId=42", "ExcNodeList=node[3,7]"]


def test_an_exclusion_list_that_does_not_parse_is_refused_not_read_as_none():
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "PENDING", "Restarts": "1", "ExcNodeList": "node[7"})
    change = Change(world=8, nodes=["node1", "node2", "node4", "node5"], excluded=["node3"])
    with pytest.raises(MscaleError, match="ExcNodeList 'node\\[7' is not a SLURM hostlist"):
        relaunch(slurm_launch(), change, 2, run=run)


def test_a_queued_again_job_that_needs_a_new_plan_must_be_cancelled_first():
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "PENDING", "ExcNodeList": "(null)"})
    out = relaunch(slurm_launch(), shrink(), 2, run=run)
    assert out.command == [] and "scancel 42" in out.refusal


@pytest.mark.parametrize("fields", [
    {"JobState": "PENDING", "Reason": "launch_failed_requeued_held", "Priority": "0"},
    {"JobState": "REQUEUE_HOLD", "Reason": "JobHeldAdmin"}])
def test_a_queued_again_job_that_is_held_is_released(fields):
    """A node that fails at batch launch requeues the job held: it never starts by itself."""
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh", **fields})
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert out.command == ["scontrol", "release", "42"] and "held" in out.notes[0]
    change = Change(world=8, nodes=["node1", "node2", "node4", "node5"], excluded=["node3"])
    out = relaunch(slurm_launch(), change, 2, run=run)
    assert out.command[:2] == ["scontrol", "update"] and "scontrol release 42" in out.notes[1]


def test_a_batch_job_still_running_is_requeued_as_before():
    """recover --execute inside the batch script after its failed srun: the job is RUNNING and
    requeues itself (the loop in docs/recover.md)."""
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh",
                    "JobState": "RUNNING"})
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert out.command == ["scontrol", "requeue", "42"]


def test_a_job_slurm_may_not_requeue_has_its_batch_script_submitted_again(tmp_path):
    """Seen on the local SLURM: a job submitted with --no-requeue was scancel'ed, and recover
    --execute ran `scontrol requeue`, which SLURM refuses for Requeue=0 ("Requested operation is
    presently disabled for job 21"): exit 3, nothing relaunched."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nsrun mscale train plan.yaml --run-dir r\n")
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": str(script), "Requeue": "0",
                    "JobState": "CANCELLED"})
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert out.command == ["sbatch", "--nodes=4", "--job-name=mscale-e2e", str(script)]
    assert out.notes == ["job 42 cannot be requeued (Requeue=0: submitted with --no-requeue or "
                         "the cluster's JobRequeue=0): submitted again"]
    script.unlink()  # a script gone since: its srun line is wrapped, as for any other change
    wrapped = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=run)
    assert wrapped.command[0] == "sbatch" and "--wrap" in wrapped.command


def test_slurm_reuses_the_batch_script_when_it_can_run_unchanged(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nsrun mscale train plan.yaml --run-dir r\n")
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": str(script)})
    change = Change(world=8, nodes=["node1", "node2", "node4", "node5"], excluded=["node3"])
    out = relaunch(slurm_launch(), change, 2, run=run)
    assert out.command == ["sbatch", "--nodes=4", "--exclude=node3", "--job-name=mscale-e2e",
                           str(script)]


def test_a_resubmission_keeps_the_nodes_the_job_already_kept_out(tmp_path):
    """sbatch --exclude=node2 job.sh (or its #SBATCH --exclude) lost node3: the script was
    resubmitted with --exclude=node3 alone, which replaces the job's, and ran on node2 again."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nsrun mscale train plan.yaml --run-dir r\n")
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": str(script),
                    "ExcNodeList": "node[2,7]"})
    change = Change(world=8, nodes=["node1", "node4", "node5", "node6"], excluded=["node3"])
    out = relaunch(slurm_launch(), change, 2, run=run)
    assert out.command[:3] == ["sbatch", "--nodes=4", "--exclude=node[2-3,7]"]
    wrapped = relaunch(slurm_launch(), shrink(resume="/abs/run/ckpt/step-000010"), 2, run=run)
    assert wrapped.command[:3] == ["sbatch", "--nodes=3", "--exclude=node[2-3,7]"]


def test_slurm_wraps_the_rewritten_srun_line_when_the_world_changes(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n")
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": str(script),
                    "Partition": "debug"})
    out = relaunch(slurm_launch(), shrink(resume="/abs/run/ckpt/step-000010"), 2, run=run)
    assert out.command[:4] == ["sbatch", "--nodes=3", "--exclude=node3",
                               "--job-name=mscale-e2e"]
    assert "--partition=debug" in out.command and "--chdir=/abs" in out.command
    # SLURM's own output goes where diagnose reads it, not into the submitter's directory
    assert "--output=/abs/run/logs/slurm-%j.out" in out.command
    wrapped = shlex.split(out.command[out.command.index("--wrap") + 1])
    assert wrapped == ["srun", "--kill-on-bad-exit=1", "--ntasks=6", "--ntasks-per-node=2",
                       MSCALE, "train", "/runs/r1/recover/plan-0001.yaml", "--run-dir",
                       "/abs/run", "--resume", "/abs/run/ckpt/step-000010"]
    assert "old world" in out.notes[0]


def test_a_wrapped_relaunch_says_which_nodes_of_the_allocation_its_step_left_out(tmp_path):
    """The batch script ran `srun -x node3 -N3 ...` in a node[1-4] allocation: the step ran on
    node[1-2,4]. SLURM records that -x nowhere (the step's environment, ExcNodeList), so the
    --wrap'd relaunch cannot keep node3 out; it must say so rather than drop it unremarked."""
    launch = slurm_launch()
    launch.nodes = ["node1", "node2", "node4"]
    run = scontrol({"JobId": "42", "BatchFlag": "1", "Command": "/abs/job.sh"})
    change = Change(world=4, nodes=["node1", "node4"], excluded=["node2"],
                    plan_path="/abs/run/recover/plan-0002.yaml")
    out = relaunch(launch, change, 2, run=run)
    assert "--wrap" in out.command and "--exclude=node2" in out.command
    assert out.notes[-1].startswith("the job's allocation held node3, which its training step "
                                    "did not run on: an srun -x inside the batch script")
    launch.nodes = NODES  # the step ran on the whole allocation: nothing to say
    assert not any("allocation held" in n for n in relaunch(launch, change, 2, run=run).notes)


def test_slurm_job_no_longer_known_is_wrapped_with_a_note():
    out = relaunch(slurm_launch(), Change(world=8, nodes=NODES), 2, run=scontrol(None))
    assert out.command[0] == "sbatch" and "--wrap" in out.command
    assert "no longer knows job 42" in out.notes[0]


def test_torchrun_from_the_record_names_nnodes_and_asks_for_rendezvous():
    launch = Launch(argv=["mscale", "train", "p.yaml", "--run-dir", "r"], nodes=NODES,
                    launcher="torchrun")
    out = relaunch(launch, shrink(), 2)
    assert out.command[:4] == ["torchrun", "--nnodes=3", "--nproc-per-node=2", "--no-python"]
    assert "rendezvous" in out.notes[0]


def test_a_given_command_wins_and_no_command_at_all_is_said():
    given = ["mscale", "train", "p.yaml", "--run-dir", "r", "--local", "8"]
    out = relaunch(slurm_launch(), shrink(), 2, command=given)
    assert out.launcher == "local" and out.command[-2:] == ["--local", "6"]
    none = relaunch(None, shrink(), 2)
    assert none.command == [] and "recorded no launch" in none.notes[0]


def test_recorded_launch_is_the_last_train_start(tmp_path):
    run = RunDir(str(tmp_path))
    starts = [{"kind": "start", "source": "train", "evidence": {"launcher": "local", "launch": {
        "argv": ["mscale", "train", f"p{i}.yaml"], "cwd": "/w", "plan": f"/w/p{i}.yaml",
        "local": 8, "nodes": NODES, "slurm": None}}} for i in (1, 2)]
    events = [*starts, {"kind": "start", "source": "preflight", "evidence": {}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    got = recorded_launch(run)
    assert got.plan == "/w/p2.yaml" and got.local == 8 and got.launcher == "local"
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "start", "source": "train",
                                                       "evidence": {}}) + "\n")
    assert recorded_launch(run) is None


def test_a_bad_events_line_does_not_stop_the_recorded_launch(tmp_path, monkeypatch):
    """A line that is not JSON (a hand edit, a damaged disk) is skipped, as the diagnosis skips
    it: the whole-file reader stopped recover with exit 3. A start older than the tail the
    diagnosis reads is still found, further back."""
    from mscale.recover import relaunch as rl

    start = {"kind": "start", "source": "train", "evidence": {"launch": {
        "argv": ["mscale", "train", "p.yaml"], "local": 2}}}
    filler = json.dumps({"kind": "info", "source": "train", "message": "x" * 200}) + "\n"
    (tmp_path / "events.jsonl").write_text(json.dumps(start) + "\nNOT JSON\n" + filler * 50)
    assert recorded_launch(RunDir(str(tmp_path))).local == 2
    monkeypatch.setattr(rl, "JSONL_TAIL_BYTES", 1000)  # the start lies before the tail
    assert recorded_launch(RunDir(str(tmp_path))).argv == ["mscale", "train", "p.yaml"]


def test_a_given_sbatch_command_gets_node_flags_before_its_script(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n")
    cmd = ["sbatch", "--wait", "-N", "4", str(script), "-N", "arg-of-the-script"]
    out = relaunch(None, shrink(), 2, command=cmd)
    assert out.command == ["sbatch", "--nodes=3", "--exclude=node3", "--wait", str(script),
                           "-N", "arg-of-the-script"]
    assert "own srun line still names the old world" in out.notes[0]
    same = relaunch(None, Change(world=8, nodes=NODES), 2, command=cmd)
    assert same.notes == [] and same.command[1] == "--nodes=4"


def test_a_given_sbatch_wrap_is_rewritten_inside():
    cmd = ["sbatch", "-N", "4", "--wrap", "srun -n 8 mscale train p.yaml --run-dir r"]
    out = relaunch(None, shrink(), 2, command=cmd)
    assert out.command[:3] == ["sbatch", "--nodes=3", "--exclude=node3"] and out.notes == []
    assert shlex.split(out.command[-1]) == [
        "srun", "--nodes=3", "--ntasks=6", "--exclude=node3", "mscale", "train",
        "/runs/r1/recover/plan-0001.yaml", "--run-dir", "r"]


@pytest.mark.parametrize("evidence", [
    "not a dict", {"launch": "argv"}, {"launch": {"argv": "mscale train"}},
    {"launch": {"argv": ["mscale", "train"], "local": "8", "nodes": "node1", "slurm": [1]}}])
def test_a_damaged_start_record_is_no_launch_or_a_sanitised_one(tmp_path, evidence):
    from mscale.recover.relaunch import recorded_launch
    from mscale.runs.rundir import RunDir

    (tmp_path / "events.jsonl").write_text(
        json.dumps([1, 2]) + "\n" + json.dumps({"kind": "start", "source": "train",
                                                "evidence": evidence}) + "\n")
    launch = recorded_launch(RunDir(str(tmp_path)))
    if launch is not None:
        assert launch.local == 0 and launch.nodes == [] and launch.slurm is None


def test_a_torchrun_relaunch_uses_the_torchrun_beside_the_jobs_python(tmp_path):
    """Started as .venv/bin/torchrun: a bare `torchrun` was not found outside the venv."""
    import sys

    from mscale.recover.relaunch import _torchrun_beside

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\n")
    (bin_dir / "torchrun").chmod(0o755)
    assert _torchrun_beside([str(bin_dir / "python3"), "-m", "mscale.cli.main"]) == str(
        bin_dir / "torchrun")
    assert _torchrun_beside(["python3", "-m", "mscale.cli.main"]) == "torchrun"
    assert _torchrun_beside([sys.executable]) in ("torchrun", str(
        __import__("pathlib").Path(sys.executable).parent / "torchrun"))


@pytest.mark.parametrize("state", ["FAILED", "PENDING"])
def test_slurm_never_requeues_a_job_whose_command_rolls_back(tmp_path, state):
    """A rollback under SLURM is a --wrap job whose command carries --resume RUN/ckpt/step-S:
    requeued or released as it is after its next failure, it rolled the run back to S on every
    restart. It is resubmitted rewritten, or (queued again by SLURM) must be cancelled first."""
    run = str(tmp_path / "run")
    argv = [MSCALE, "train", "p.yaml", "--run-dir", run, "--resume", f"{run}/ckpt/step-000004"]
    launch = Launch(argv=argv, cwd=str(tmp_path), launcher="slurm", nodes=NODES,
                    slurm={"job_id": "77"})
    scontrol_run = scontrol({"JobId": "77", "BatchFlag": "1", "Command": "(null)",
                             "JobState": state})
    out = relaunch(launch, Change(world=8, nodes=NODES, run_dir=run), 2, run=scontrol_run)
    if state == "PENDING":
        assert out.command == [] and "scancel 77" in out.refusal
    else:
        assert out.command[0] == "sbatch" and "--wrap" in out.command
        wrapped = shlex.split(out.command[-1])
        assert wrapped[-2:] == ["--resume", "auto"], wrapped
