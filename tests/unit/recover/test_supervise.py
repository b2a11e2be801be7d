"""`mscale.recover.supervise` against a fake job: a small script that writes what ``train``
writes (start/stop events, metrics records) and ends as told per attempt, and a fake planner.

Nothing here sleeps to synchronise: the job and supervise meet through files, and supervise's
``sleep`` is the hook where a test acts (send a signal) once the job said it is ready.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from mscale.errors import MscaleError
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, RecoveryPlan
from mscale.recover.supervise import (SuperviseOptions, Supervisor, backoff_for, find_run_dir,
                                      job_nodes, quarantined)
from mscale.runs.rundir import RunDir

JOB = r'''
import json, os, signal, sys, time
run, script = sys.argv[1], json.loads(sys.argv[2])
os.makedirs(run + "/control", exist_ok=True)
n = 1 + sum(1 for _ in open(run + "/attempts")) if os.path.exists(run + "/attempts") else 1
open(run + "/attempts", "a").write("x\n")
plan = script[min(n, len(script)) - 1]
def put(name, rec):
    with open(run + "/" + name, "a") as f:
        f.write(json.dumps({"time": time.time(), **rec}) + "\n")
put("events.jsonl", {"source": "train", "kind": "start", "evidence": {"attempt": n}})
for step in range(plan["first"], plan["last"] + 1):
    put("metrics.jsonl", {"step": step, "loss": 1.0 / step})
halted = [False]
signal.signal(signal.SIGTERM, lambda *a: halted.__setitem__(0, True))
if plan.get("quarantine"):
    q = {"entries": [{"node": plan["quarantine"], "reason": "watch: slow", "since": time.time()}]}
    json.dump(q, open(run + "/quarantine.json", "w"))
if plan.get("wait"):  # until supervise asks for a halt (file) or passes a signal on
    open(run + "/ready", "w").close()
    deadline = time.time() + plan["wait"]
    while not (os.path.exists(run + "/control/halt") or halted[0]) and time.time() < deadline:
        time.sleep(0.01)
if plan.get("sigint"):  # a Ctrl-C where nothing catches it: Python ends the process by SIGINT
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
code = plan["code"]
if not plan.get("silent"):  # a launcher or wrapper that fails before train records its stop
    put("events.jsonl", {"source": "train", "kind": "stop", "evidence": {"code": code}})
sys.exit(code)
'''


def job(tmp_path: Path, *attempts: dict) -> tuple[list[str], Path]:
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    return [sys.executable, str(tmp_path / "job.py"), str(run), json.dumps(list(attempts)),
            "--run-dir", str(run)], run


class FakePlanner:
    """Returns a plan of the given verdict whose command is the same job; records its calls."""

    def __init__(self, verdict: str = "relaunchable"):
        self.verdict, self.calls = verdict, []

    def __call__(self, run_dir, command, opts) -> RecoveryPlan:
        self.calls.append(command)
        bad = self.verdict == "unrecoverable"
        return RecoveryPlan(
            run_dir=run_dir, verdict=self.verdict,
            diagnosis=Diagnosis(cls="software", symptom="crash", summary="rank 1 crashed"),
            checkpoint=CheckpointChoice(path=f"{run_dir}/ckpt/step-000002", step=2, reason="x"),
            exclusions=Exclusions(), command=[] if bad else list(command),
            reasons=["bad input: fix the plan"] if bad else [])


def supervise(command, planner, **opts) -> tuple[int, Supervisor]:
    sup = Supervisor(command, SuperviseOptions(watch=False, backoff_s=0, interval_s=0.02,
                                               **opts), planner=planner)
    return sup.run_all(), sup


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


def phases(run: Path) -> dict[str, dict]:
    return {e["evidence"]["phase"]: e["evidence"] for e in events(run)
            if e["source"] == "recover" and e["kind"] == "recover"}


def test_a_crash_is_recovered_and_every_phase_timed(tmp_path, capfd):
    cmd, run = job(tmp_path, {"first": 1, "last": 3, "code": 3},
                   {"first": 3, "last": 6, "code": 0})
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 0 and len(planner.calls) == 1 and len(sup.restarts) == 1
    got = phases(run)
    assert list(got) == ["detect", "diagnose", "restart", "catch_up", "total"]
    assert all(p["seconds"] is not None and p["seconds"] >= 0 for p in got.values())
    assert got["detect"]["failed_step"] == 3 and got["catch_up"]["step"] == 4  # passes step 3
    assert got["diagnose"]["verdict"] == "relaunchable" and got["restart"]["attempt"] == 2
    assert got["total"]["seconds"] >= got["restart"]["seconds"] + got["catch_up"]["seconds"]
    state = json.loads((run / "recover" / "supervise.json").read_text())
    assert state["status"] == "finished" and [a["code"] for a in state["attempts"]] == [3, 0]
    err = capfd.readouterr().err.splitlines()
    assert "the job exited 3; recovering (detected in" in "\n".join(err)
    assert err[-1].startswith("recover supervise: the job finished (exit 0) after 1 relaunch;")


def test_the_budget_ends_supervision_with_exit_2(tmp_path, capfd):
    cmd, run = job(tmp_path, {"first": 1, "last": 1, "code": 3})
    planner = FakePlanner()
    code, sup = supervise(cmd, planner, max_restarts=2)
    assert code == 2 and len(sup.restarts) == 2 and len(planner.calls) == 2
    assert "restart budget spent: 2 restarts" in capfd.readouterr().err
    assert json.loads((run / "recover" / "supervise.json").read_text())["status"] == "budget spent"


def test_an_unrecoverable_plan_stops_with_its_exit_code(tmp_path, capfd):
    cmd, run = job(tmp_path, {"first": 1, "last": 1, "code": 3})
    code, sup = supervise(cmd, FakePlanner("unrecoverable"))
    assert code == 2 and sup.restarts == []
    assert "unrecoverable: bad input: fix the plan" in capfd.readouterr().err
    assert (run / "attempts").read_text().count("x") == 1


class FinishedPlanner(FakePlanner):
    """What recover answers for a run whose last record is a finish (its exit code aside)."""

    def __call__(self, run_dir, command, opts) -> RecoveryPlan:
        plan = super().__call__(run_dir, command, opts)
        plan.diagnosis = Diagnosis(cls="none", symptom="finished", summary="every step done")
        return plan


def test_a_job_that_exits_non_zero_after_finishing_is_not_restarted(tmp_path, capfd):
    """A launcher or wrapper failing after the last step (a final barrier): nothing to redo."""
    cmd, run = job(tmp_path, {"first": 1, "last": 4, "code": 3})
    planner = FinishedPlanner()
    code, sup = supervise(cmd, planner)
    assert code == 0 and sup.restarts == [] and len(planner.calls) == 1
    assert "the run finished every step: nothing to recover" in capfd.readouterr().err
    assert json.loads((run / "recover" / "supervise.json").read_text())["status"] == "finished"


def test_an_interrupted_job_is_not_restarted(tmp_path, capfd):
    """Exit 130: the operator stopped the job itself (a second Ctrl-C to it), not a failure."""
    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 130})
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 130 and planner.calls == [] and sup.restarts == []
    assert "the job was interrupted" in capfd.readouterr().err
    assert json.loads((run / "recover" / "supervise.json").read_text())["status"] == "halted"


def test_a_job_killed_by_sigint_is_interrupted_130_not_a_failure(tmp_path, capfd):
    """A Ctrl-C that lands as the job ends kills it by SIGINT (-2): the operator's interruption,
    as 130 is, not a failure to relaunch."""
    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 0, "sigint": True})
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 130 and planner.calls == [] and sup.restarts == []
    assert "the job was interrupted" in capfd.readouterr().err


def test_a_halt_on_request_is_not_restarted(tmp_path):
    cmd, _ = job(tmp_path, {"first": 1, "last": 2, "code": 1})
    planner = FakePlanner()
    code, _ = supervise(cmd, planner)
    assert code == 1 and planner.calls == []


def test_exit_1_without_trains_own_stop_is_a_failure_not_a_halt(tmp_path):
    cmd, _ = job(tmp_path, {"first": 1, "last": 2, "code": 1, "silent": True},
                 {"first": 3, "last": 4, "code": 0})
    planner = FakePlanner()
    code, _ = supervise(cmd, planner)
    assert code == 0 and len(planner.calls) == 1


def test_a_node_quarantined_while_running_halts_the_job_then_recovers(tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 4, "code": 1, "quarantine": "node2",
                              "wait": 20}, {"first": 5, "last": 6, "code": 0})
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 0 and len(planner.calls) == 1
    assert sup.log[0]["stopped_for"][1] == "quarantine.json: node2"
    got = phases(run)
    assert got["detect"]["failure_source"] == "quarantine.json: node2"
    assert got["catch_up"]["step"] == 5  # zero steps lost: the first new step catches up
    assert not (run / "control" / "halt").exists()  # the fake job does not consume it: supervise
    # removed its own request, which would otherwise halt the relaunch at its first step


def test_a_node_outside_the_job_quarantined_is_left_alone(tmp_path):
    """node7 is not in the job's plan (node[1-2]): no halt; the job's own end stands."""
    from tests.e2e.train_run import small_plan

    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 0, "quarantine": "node7",
                              "wait": 1.5})
    (run / "plan.yaml").write_text(Path(small_plan(tmp_path)).read_text())
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 0 and planner.calls == [] and sup.log[0]["stopped_for"] is None
    assert not (run / "control" / "halt").exists()


def test_a_signal_is_passed_on_and_ends_supervision(tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 1, "wait": 20})
    planner = FakePlanner()
    sup = Supervisor(cmd, SuperviseOptions(watch=False, backoff_s=0, interval_s=0.02),
                     planner=planner)

    def sleep(s: float) -> None:
        if (run / "ready").exists() and sup.signalled is None:
            sup._on_signal(signal.SIGTERM, None)
        time.sleep(s)

    sup.sleep = sleep
    assert sup.run_all() == 1 and planner.calls == []
    assert not (run / "control" / "halt").exists()  # the job stopped on the signal itself


def test_find_run_dir_and_backoff():
    assert find_run_dir(["mscale", "train", "p.yaml", "--run-dir", "runs/a"]) == "runs/a"
    assert find_run_dir(["x", "--run-dir=runs/b"]) == "runs/b"
    with pytest.raises(MscaleError, match="no --run-dir"):
        find_run_dir(["mscale", "train", "p.yaml"])
    opts = SuperviseOptions(backoff_s=10, max_backoff_s=60)
    assert [backoff_for(opts, n) for n in range(4)] == [10, 20, 40, 60]


def test_quarantined_ignores_expired_and_unreadable(tmp_path):
    run = RunDir(str(tmp_path))
    assert quarantined(run, 100.0) == {}
    (tmp_path / "quarantine.json").write_text("{not json")
    assert quarantined(run, 100.0) == {}
    (tmp_path / "quarantine.json").write_text(json.dumps({"entries": [
        {"node": "a", "reason": "r", "since": 1.0, "expires": 50.0},
        {"node": "b", "reason": "r", "since": 2.0}]}))
    assert quarantined(run, 100.0) == {"b": 2.0}


def test_the_jobs_nodes_are_slurms_names_for_them(tmp_path):
    """Plan node[1-4], run by SLURM on node[5-8]: an operator's quarantine of node7 (SLURM's
    name, as quarantine.json is documented) is this job's node, and one of node2 is another
    job's, not this one's to halt for (it bears a plan name only). Before any start event the
    plan's names are all there is."""
    plan = (Path(__file__).resolve().parents[3] / "plans" / "cpu-tiny.yaml").read_text()
    (tmp_path / "plan.yaml").write_text(plan)
    assert job_nodes(RunDir(str(tmp_path))) == {"node1", "node2", "node3", "node4"}
    start = {"kind": "start", "source": "train", "time": 1.0, "evidence": {"launch": {
        "argv": ["mscale", "train"], "nodes": ["node5", "node6", "node7", "node8"]}}}
    (tmp_path / "events.jsonl").write_text(json.dumps(start) + "\n")
    assert job_nodes(RunDir(str(tmp_path))) == {"node5", "node6", "node7", "node8"}


def test_a_command_that_cannot_start_is_bad_input(tmp_path):
    sup = Supervisor([str(tmp_path / "nope"), "--run-dir", str(tmp_path / "run")],
                     SuperviseOptions(watch=False), planner=FakePlanner())
    with pytest.raises(MscaleError, match="cannot run .*nope") as e:
        sup.run_all()
    assert e.value.code == 3


def test_failure_time_is_the_earliest_record_of_this_attempt(tmp_path):
    from mscale.recover.phases import failure_time

    run = RunDir(str(tmp_path))
    (tmp_path / "logs").mkdir()
    put = lambda rows: (tmp_path / "events.jsonl").write_text(  # noqa: E731
        "".join(json.dumps({"source": "train", **r}) + "\n" for r in rows))
    put([{"kind": "stop", "time": 5.0, "evidence": {"code": 3}},       # an earlier attempt's
         {"kind": "start", "time": 10.0},
         {"kind": "stop", "time": 12.0, "evidence": {"code": 0}},      # a clean stop is no failure
         {"kind": "hang", "time": 14.0}])
    assert failure_time(run, 10.0, 99.0) == (14.0, "events.jsonl: hang")
    (tmp_path / "logs" / "rank2.error.json").write_text(json.dumps(
        {"rank": 2, "kind": "timeout", "time": 13.5}))
    assert failure_time(run, 10.0, 99.0) == (13.5, "logs/rank2.error.json")
    put([{"kind": "start", "time": 10.0}])
    (tmp_path / "logs" / "rank2.error.json").unlink()
    assert failure_time(run, 10.0, 99.0) == (99.0, "the job's exit")


def test_steps_written_while_the_start_is_read_still_end_the_catch_up(tmp_path, monkeypatch):
    """The relaunched job writes its start and its first steps between supervise's reads of
    events and metrics: the catch-up must still end at the first step past the failure."""
    from mscale.recover import phases as phases_mod
    run = RunDir(str(tmp_path))
    log = phases_mod.PhaseLog(run)
    log.watch_attempt()
    log.failed(launched_at=time.time(), failed_step=3)
    log.mark("relaunched")
    real_read, written = phases_mod.read_events, []

    def read_then_the_job_writes(r):
        seen = real_read(r)
        if not written:  # the job's start and steps land just after this read
            written.append(1)
            with open(r.events, "a") as f:
                f.write(json.dumps({"time": time.time(), "source": "train", "kind": "start",
                                    "evidence": {"attempt": 2}}) + "\n")
            with open(r.metrics, "a") as f:
                for step in (4, 5):
                    f.write(json.dumps({"time": time.time(), "step": step, "loss": 1.0}) + "\n")
        return seen

    monkeypatch.setattr(phases_mod, "read_events", read_then_the_job_writes)
    for _ in range(3):
        log.poll()
    assert log.current.marks.get("caught_up") is not None
    got = {e["evidence"]["phase"]: e["evidence"] for e in events(tmp_path)
           if e["source"] == "recover"}
    assert got["catch_up"]["step"] == 4


def test_a_command_that_fails_before_the_job_starts_is_not_relaunched(tmp_path, capfd):
    """A typo in the plan's path exits 3 before any record: the run's older records (here a
    finished attempt) say nothing of it, and a relaunch would fail the same way."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps(
        {"source": "train", "kind": "stop", "time": time.time() - 600,
         "evidence": {"code": 0}}) + "\n")
    cmd = [sys.executable, "-c", "import sys; print('error: plans/cpu-tny.yaml: file not "
           "found'); sys.exit(3)", "--run-dir", str(run)]
    planner = FakePlanner()
    code, sup = supervise(cmd, planner)
    assert code == 3 and planner.calls == [] and sup.restarts == []
    assert "before the job started" in capfd.readouterr().err
    assert json.loads((run / "recover" / "supervise.json").read_text())["status"] == \
        "failed to start"
