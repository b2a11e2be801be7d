"""diagnose(): how the last attempt ended, one fabricated run per case in the writers' real
shapes: finished, halted, preempted or stopped by the operator, killed, numerics (NaN, a
divergence, repeated spikes), a slow node watch quarantined, a dead launcher. What failed, by
its words: test_diagnose_errors.py; SLURM and srun: test_diagnose_slurm.py."""

from __future__ import annotations

import json

import pytest

from mscale.recover.diagnose import diagnose
from tests.unit.recover.diag_runs import (GLOO_CLOSED, GLOO_RESET, T0, Run,
                                         run, started)  # noqa: F401 - a fixture


def test_a_finished_run_is_none_finished(run):
    rid = started(run, 4)
    run.finish(10, 0, 4, rid)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code, d.attempt, d.failed_step) == (
        "none", "finished", 0, 1, 4)
    assert d.suspect_ranks == [] and d.suspect_nodes == []


def test_a_halt_is_none_stopped(run):
    rid = started(run)
    run.event("control", 5, step=3, message="saving a checkpoint, then halting")
    run.finish(6, 1, 3, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 1)


def test_a_sigterm_stop_is_a_preemption(run):
    rid = started(run)
    run.event("signal", 5, step=3, message="saving a checkpoint, then halting on a signal")
    run.finish(6, 1, 3, rid, reason="signal")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP"])
def test_a_ctrl_c_or_hangup_stop_is_the_operators_request_not_a_preemption(run, sig):
    """Also as rank 0 records it when the --local launcher got the signal alone and passed it
    on as SIGTERM (it names the launcher's signal)."""
    rid = started(run)
    run.finish(6, 1, 3, rid, reason="signal", signal=sig)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 1)


def test_an_interruption_blames_no_node_whatever_the_dying_ranks_wrote(run):
    """A second Ctrl-C under --local: the launcher's ``interrupted`` stop; a rank that saw its
    peer vanish first wrote a network error file, which is no evidence against its node."""
    rid = started(run)
    run.error_file(1, 5, "network", "RuntimeError: Connection closed by peer")
    run.event("stop", 6, severity="warning", message="interrupted: a second Ctrl-C stopped the "
              "workers at once, without a checkpoint; no checkpoint was saved yet",
              evidence={"run_id": rid, "reason": "interrupted", "signal": "SIGINT",
                        "forced": True, "code": 130, "returncodes": [-9, -9, -9, -9]})
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 130)
    assert d.suspect_nodes == [] and d.suspect_ranks == []


def test_kill_9_blames_the_killed_rank_not_the_peers_that_lost_it(run):
    rid = started(run)
    for rank, msg in ((0, GLOO_RESET), (1, GLOO_CLOSED), (3, GLOO_RESET)):
        run.error_file(rank, 5 + rank / 100, "network", msg)
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient, d.exit_code) == ("unknown", "signal", True, 3)
    assert d.suspect_ranks == [2] and d.suspect_nodes == ["node2"]
    assert "SIGKILL" in d.evidence[0].text and d.failed_step == 3


def test_nan_is_numerics_with_its_step(run):
    rid = started(run, 2)
    run.event("nan", 4, step=3, severity="critical", message="non-finite gradient norm: stopped "
              "before the optimizer step", evidence={"grad_norm": "nan", "loss": "nan"})
    run.finish(5, 2, 2, rid, reason="nan")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step, d.failed_step, d.exit_code, d.transient) == \
        ("numerics", "nan", 3, 2, 2, True)


def test_a_divergence_names_its_first_bad_step(run):
    rid = started(run, 60)
    run.event("divergence", 70, source="watch", step=60, severity="critical",
              message="the loss diverges", evidence={"first_bad_step": 48, "first_step": 48})
    run.event("control", 71, step=60, message="halting on a control/halt request")
    run.finish(72, 1, 60, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step) == ("numerics", "divergence", 48)
    assert not d.transient and d.suspect_nodes == []


def test_repeated_spikes_roll_back_to_the_first_of_the_episode(run):
    rid = started(run, 60)
    for step in (10, 40, 45, 52):
        run.event("grad_spike", step, source="watch", step=step, severity="warning",
                  message=f"gradient norm spike at step {step}",
                  evidence={"first_step": step, "last_step": step})
    run.finish(80, 1, 60, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step) == ("numerics", "divergence", 40)


def test_one_spike_in_a_finished_run_is_nothing(run):
    rid = started(run, 20)
    run.event("grad_spike", 10, source="watch", step=10, evidence={"first_step": 10})
    run.finish(30, 0, 20, rid)
    assert diagnose(run.path).cls == "none"


def test_a_slow_node_quarantined_by_watch_then_halted(run):
    rid = started(run, 30)
    run.event("straggler", 20, source="watch", step=30, severity="warning", ranks=[2, 3],
              nodes=["node2"], message="node2 is 40% slower",
              evidence={"cause": "slow_node", "action": "checkpoint requested", "first_step": 24})
    run.finish(25, 1, 30, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("gpu", "straggler")
    assert d.suspect_ranks == [2, 3] and d.suspect_nodes == ["node2"]
    # watch says "step 24", its onset; the event's step is when it was found
    assert any("watch straggler at step 30 (since step 24):" in e.text for e in d.evidence)


def test_an_empty_run_directory_is_unknown_not_an_error(tmp_path):
    """No train record at all: the attempt is unknown, not "attempt 1" (the report said so
    beside the steps of a run whose events were lost)."""
    (tmp_path / "empty").mkdir()
    d = diagnose(str(tmp_path / "empty"))
    assert (d.cls, d.symptom, d.attempt, d.exit_code) == ("unknown", "unknown", None, None)
    assert "attempt" not in d.summary


def test_a_node_quarantined_during_the_attempt_is_the_reason_of_its_halt(run):
    """supervise halts the job when quarantine.json takes a node in (watch, or an operator)."""
    rid = started(run, 30)
    run.file("quarantine.json", json.dumps({"schema_version": 1, "entries": [
        {"node": "node1", "reason": "operator: fan failure", "since": T0 + 20, "expires": None},
        {"node": "node9", "reason": "old", "since": T0 - 5000, "expires": None}]}))
    run.event("control", 24, step=30, message="halting on a control/halt request")
    run.finish(25, 1, 30, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_nodes) == ("gpu", "straggler", ["node1"])


def test_train_s_own_lines_quoting_a_path_are_not_evidence(run):
    rid = started(run, 4)
    run.log(0, "training cpu-tiny: tp2·pp1·dp2 on 4 processes (local, cpu), run local-1 attempt 1,"
            " run directory /scratch/oom-kill-enospc-test\nstep 1/8  loss 5.55\n")
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("unknown", "signal")
    assert not any(e.source == "logs/rank0.log" for e in d.evidence)


def test_a_dead_launcher_blames_no_node_and_a_closed_console_is_software(run, tmp_path):
    """train --local's workers stop themselves when their launcher dies (launcher_died on every
    rank, a peer's collective broken by the first to stop): nothing of a node or the network.
    A rank whose stdout/stderr reader went away (kind console) is not a network fault, though
    its traceback says 'Broken pipe'."""
    started(run)
    for rank in range(4):
        run.error_file(rank, 6, "launcher_died", "the --local launcher is gone (killed)")
    run.error_file(2, 6, "network", "RuntimeError: Connection closed by peer")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)
    assert d.suspect_nodes == [] and d.suspect_ranks == []

    other = Run(tmp_path / "console")
    started(other)
    other.error_file(0, 5, "console", "BrokenPipeError: [Errno 32] Broken pipe")
    d = diagnose(other.path)
    assert (d.cls, d.symptom) == ("software", "crash") and d.suspect_nodes == []

