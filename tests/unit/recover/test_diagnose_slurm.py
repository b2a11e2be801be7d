"""diagnose() under SLURM and srun (recover/diagnose/slurm.py): slurmstepd's preemption, time
limit and node failure lines, srun's task lines naming a killed or silent rank and its node, and
a step cancelled by ``srun --kill-on-bad-exit=1`` after a failure told from an operator's
scancel (read in the nodes' time zone)."""

from __future__ import annotations

import time

import pytest

from mscale.recover.diagnose import diagnose
from tests.unit.recover.diag_runs import (GLOO_RESET, GLOO_TIMEOUT, T0, Run,
                                         run, started)  # noqa: F401 - a fixture


@pytest.mark.parametrize("line", [
    "slurmstepd: error: *** JOB 1234 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO "
    "PREEMPTION ***",
    "slurmstepd: error: *** STEP 1234.0 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO TIME "
    "LIMIT ***"])
def test_slurm_preemption_and_time_limit_explain_the_signals(run, line):
    rid = started(run)
    run.event("signal", 5, step=3, message="halting on a signal")
    run.finish(6, 1, 3, rid, reason="signal")
    run.file("slurm-1234.out", f"step 3/100 loss 5.1\n{line}\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)
    assert d.evidence[0].source == "slurm-1234.out" and "DUE TO" in d.evidence[0].text
    assert d.suspect_nodes == []


def test_a_node_failure_names_the_node(run):
    started(run)
    run.file("logs/slurm-77.out", "srun: error: Node failure on node2\nslurmstepd: error: *** "
             "JOB 77 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO NODE FAILURE ***\n", t=8)
    d = diagnose(run.path)
    assert d.cls == "preemption" and d.suspect_nodes == ["node2"]


def test_scancel_is_a_stop_not_a_preemption(run):
    rid = started(run)
    run.finish(6, 1, 3, rid, reason="signal")
    run.file("slurm-9.out", "slurmstepd: error: *** JOB 9 ON node1 CANCELLED AT "
             "2026-11-30T14:00:01 ***\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped")


def test_a_rank_gone_silently_under_srun_is_the_suspect(run):
    """No launcher event: rank 0 records its own view; the rank without an error file is the one
    its peers lost."""
    started(run)
    for rank in (0, 1, 2):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 6, severity="critical", ranks=[0], nodes=["node1"],
              message="error (rank 0 on node1, network): ...",
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "crash")
    assert d.suspect_ranks == [3] and d.suspect_nodes == ["node2"] and d.exit_code == 3


def test_when_every_rank_timed_out_under_srun_none_is_named_and_the_report_says_why(run):
    """SLURM continues a stopped rank (SIGCONT, then SIGTERM) when it ends the step: that rank
    times out at once too, so every rank has a timeout file and none is the silent one."""
    from mscale.recover.diagnose.hang import EVERY_RANK_WAITED

    started(run)
    for rank in range(4):
        run.error_file(rank, 5 + rank / 100, "timeout", GLOO_TIMEOUT, node=f"node{rank + 1}")
    run.event("hang", 6, severity="critical", ranks=[0], nodes=["node1"],  # rank 0's, as srun's
              message="error (rank 0 on node1, timeout): ...",
              evidence={"kind": "timeout", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert d.symptom == "hang" and d.suspect_ranks == [] and d.suspect_nodes == []
    assert any(e.text == f"suspect rank(s): {EVERY_RANK_WAITED}" for e in d.evidence)


def test_srun_names_a_killed_task_and_its_node(run):
    run.start(0.0, run_id="slurm-55", launcher="slurm")
    run.error_file(0, 5, "network", GLOO_RESET, node="nodeA")
    run.file("slurm-55.out", "srun: error: nodeB: task 3: Killed\n", t=6)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("unknown", "signal")
    assert d.suspect_ranks == [3] and d.suspect_nodes == ["nodeB"]


def test_a_node_whose_ranks_vanished_under_srun(tmp_path):
    """Both ranks of node3 SIGKILLed under sbatch/srun: the six peers write network error files
    with their real host names, rank 0 records its own stop; the silent node is the suspect."""
    run = Run(tmp_path / "run", nodes="node[1-4]", tp=2, dp=4)
    launch = {"argv": ["mscale", "train", "plan.yaml"], "nodes": ["node1", "node2", "node3",
                                                                  "node4"],
              "slurm": {"job_id": "42", "job_name": "t", "nodelist": "node[1-4]", "nnodes": 4}}
    run.start(0.0, run_id="slurm-42.0", launcher="slurm", launch=launch)
    run.metrics(range(1, 6), t=1)
    for rank in (0, 1, 2, 3, 6, 7):
        run.error_file(rank, 20 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 21, severity="critical", ranks=[0], nodes=["node1"],
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert (d.cls, d.suspect_ranks, d.suspect_nodes, d.exit_code) == \
        ("network", [4, 5], ["node3"], 3)


# -- srun --kill-on-bad-exit=1: the step's cancel is its teardown, not an operator's scancel ---


def _stamp(t: float) -> str:
    """slurmstepd's time of a cancel (the node's local time, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + t))


def _killed_under_srun(tmp_path) -> Run:
    """The trial's run: 8 ranks on node[1-4] under ``srun --kill-on-bad-exit=1 --output
    RUN/logs/…``; rank 4 (node3) SIGKILLed; its peers lose it; srun says so, cancels the step,
    and the other tasks end with it."""
    run = Run(tmp_path / "r1", nodes="node[1-4]", tp=2, dp=4)
    run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    for rank in (0, 5):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 5.5, severity="critical", ranks=[0], nodes=["node1"],
              message="error (rank 0 on node1, network): ...",
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    run.file("logs/slurm-25.out",
             "step 3/100 loss 5.1\n"
             "srun: error: node3: task 4: Killed\n"
             "srun: launch/slurm: _step_signal: Terminating StepId=25.0\n"
             f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             "srun: error: node1: tasks 0-1: Killed\n"
             "srun: error: node3: task 5: Exited with exit code 3\n", t=7)
    return run


def test_kill_on_bad_exit_blames_the_killed_rank_not_a_scancel(tmp_path):
    d = diagnose(_killed_under_srun(tmp_path).path)
    assert (d.cls, d.symptom) == ("unknown", "signal"), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]
    assert "task 4: Killed" in d.evidence[0].text
    assert "cancelled (scancel)" not in d.summary


def test_kill_on_bad_exit_with_an_xid_is_the_gpu_and_excludes_its_node(tmp_path):
    from mscale.recover.exclude import decide_exclusions
    from mscale.runs.rundir import RunDir

    run = _killed_under_srun(tmp_path)
    run.log(4, "step 3/100 loss 5.1\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen "
            "off the bus.\n", t=5)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("gpu", "crash", False), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]
    assert decide_exclusions(RunDir(run.path), d).nodes == ["node3"]


def test_a_step_cancel_after_a_failed_rank_with_no_srun_line_is_no_scancel(tmp_path):
    """The step's cancel in a rank's own --output file, srun's own lines elsewhere: the error
    files written before it say the job failed first."""
    _failed_then_cancelled(tmp_path, _stamp(6))


def _failed_then_cancelled(tmp_path, stamp: str, launch: dict | None = None) -> None:
    """Every rank but 4 fails at T0 + 5 (rank 4's loss), the step is cancelled at ``stamp``:
    diagnosed as the network failure, not a scancel."""
    run = Run(tmp_path / "r1", nodes="node[1-4]", tp=2, dp=4)
    run.start(0.0, run_id="slurm-25", launcher="slurm", launch=launch)
    run.metrics(range(1, 4), t=1.0)
    for rank in (0, 1, 2, 3, 5, 6, 7):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.log(1, f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {stamp} ***\n", t=6)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "crash"), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]


def test_a_cancel_is_read_in_the_nodes_time_zone_not_recovers(tmp_path):
    """The nodes keep UTC-9, recover runs in this machine's zone: read as local time here the
    cancel's stamp would lie hours before the failures and the step's teardown would read as an
    operator's scancel; the start event's recorded offset places it after them."""
    offset = time.localtime(T0).tm_gmtoff - 9 * 3600  # nine hours west of this machine
    node_time = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + 6 + offset))
    _failed_then_cancelled(tmp_path, node_time, launch={
        "nodes": ["node1", "node2", "node3", "node4"], "utc_offset_s": offset})


def test_an_operators_step_scancel_is_still_a_stop(run):
    """``scancel 25.0``: no task failed before the cancel; the tasks' SIGTERM stop and srun's
    lines about them come after it."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT "
             f"{_stamp(6)} ***\nsrun: error: node1: tasks 0-1: Exited with exit code 1\n"
             "srun: error: node2: tasks 2-3: Terminated\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and "scancel" in d.summary


def test_an_operators_job_scancel_is_still_a_stop_whatever_the_step_says(run):
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", f"slurmstepd: error: *** JOB 25 ON node1 CANCELLED AT {_stamp(6)} "
             f"***\nslurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             "srun: error: node1: tasks 0-3: Terminated\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and d.suspect_nodes == []


def test_supervises_own_halt_under_slurm_is_the_slow_link_not_a_scancel(run):
    """``recover supervise --watch -- srun --kill-on-bad-exit=1 …``: watch names a slow link,
    supervise asks for a halt, the tasks exit 1 after the checkpoint, srun cancels the step."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 31), t=1.0)
    run.event("straggler", 20, source="watch", step=30, severity="warning", ranks=[2, 3],
              nodes=["node2"], message="the link to node2 is slow",
              evidence={"cause": "slow_link", "action": "checkpoint requested"})
    run.event("control", 24, step=30, message="halting on a control/halt request")
    run.finish(25, 1, 30, rid, reason="halt")
    run.file("slurm-25.out", "srun: error: node1: task 0: Exited with exit code 1\n"
             f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(26)} ***\n"
             "srun: error: node2: tasks 2-3: Exited with exit code 1\n", t=27)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "straggler"), d.summary
    assert d.suspect_nodes == ["node2"] and "scancel" not in d.summary


def test_a_step_of_a_job_cancelled_due_to_a_time_limit_is_the_time_limit(run):
    run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.file("slurm-25.out", f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT "
             f"{_stamp(6)} ***\nslurmstepd: error: *** JOB 25 ON node1 CANCELLED AT "
             f"{_stamp(6)} DUE TO TIME LIMIT ***\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("preemption", "preempted")
    assert all(not (h.source == "slurm-25.out" and "STEP" in h.text and h is d.evidence[0])
               for h in d.evidence)


def test_a_job_scancel_after_an_earlier_steps_failure_is_still_the_operators(run):
    """--open-mode=append keeps every step in one file: preflight's step exited 1 (its warnings),
    training ran, then the operator cancelled the job."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", "srun: error: node1: tasks 0-3: Exited with exit code 1\n"
             f"slurmstepd: error: *** JOB 25 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             f"slurmstepd: error: *** STEP 25.1 ON node1 CANCELLED AT {_stamp(6)} ***\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and "scancel" in d.summary
