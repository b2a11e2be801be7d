"""supervise and the run-directory lock: it refuses a run another live job holds (before it
starts anything, and after its own job ended when someone else still holds it), but never trips
over its own job's lock — gone with its pid, let go a moment late, or held from another host
until its lease runs out. And a --local job is not halted for a quarantined pretend node.

The jobs are small scripts that take the real lock (`mscale.runs.lock.RunLock`) the way
``train`` does; the planner is faked, as in test_supervise.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from mscale.recover import liveness
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, RecoveryPlan
from mscale.recover.liveness import RunInUse
from mscale.recover.supervise import SuperviseOptions, Supervisor
from mscale.runs.lock import RunLock, live_holder

from tests.unit.recover.test_live_run import HOLDER

JOB = r'''
import json, os, socket, subprocess, sys, time
run, script, side = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
n = 1 + sum(1 for _ in open(side + "/attempts")) if os.path.exists(side + "/attempts") else 1
open(side + "/attempts", "a").write("x\n")
plan = script[min(n, len(script)) - 1]
def put(rec):
    with open(run + "/events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "source": "train", **rec}) + "\n")
from mscale.runs.lock import RunLock
mode, lock = plan.get("lock"), None
if mode == "own":          # rank 0's lock, as train holds it; a failing job dies holding it
    lock = RunLock(run, f"job-{n}").acquire()
elif mode == "linger":     # a process outside the job's group holds it a while after the job
    ready = side + f"/ready-{n}"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, run, ready, str(plan["hold"])],
                         start_new_session=True)
    open(side + "/holder.pid", "w").write(str(p.pid))
    while not os.path.exists(ready):
        time.sleep(0.01)
elif mode == "remote":     # rank 0 ran on another host: its heartbeat outlives it by the lease
    now = time.time()
    json.dump({"run_id": f"job-{n}", "host": "gpu-node-17", "pid": 4242, "since": now,
               "heartbeat": now, "lease_s": plan["lease"], "token": "r" * 32},
              open(run + "/lock.json", "w"))
put({"kind": "start", "evidence": {"attempt": n}})
for step in range(plan["first"], plan["last"] + 1):
    with open(run + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "step": step, "loss": 1.0}) + "\n")
if plan.get("quarantine"):
    json.dump({"entries": [{"node": plan["quarantine"], "reason": "watch: slow",
                            "since": time.time()}]}, open(run + "/quarantine.json", "w"))
    deadline = time.time() + plan["wait"]
    while not os.path.exists(run + "/control/halt") and time.time() < deadline:
        time.sleep(0.01)
put({"kind": "stop", "evidence": {"code": plan["code"]}})
if plan["code"] == 0 and lock is not None:
    lock.release()
sys.stdout.flush()
os._exit(plan["code"])
'''.replace("HOLDER", repr(HOLDER))


def job(tmp_path: Path, *attempts: dict, extra: tuple[str, ...] = ()) -> tuple[list[str], Path]:
    run, side = tmp_path / "run", tmp_path / "side"
    run.mkdir()
    (run / "control").mkdir()
    side.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    return [sys.executable, str(tmp_path / "job.py"), str(run), json.dumps(list(attempts)),
            str(side), "--run-dir", str(run), *extra], run


class Planner:
    """Relaunch the same job; records, at each call, who held the run directory."""

    def __init__(self):
        self.calls, self.holders = [], []

    def __call__(self, run_dir, command, opts) -> RecoveryPlan:
        self.calls.append(command)
        self.holders.append(live_holder(run_dir))
        return RecoveryPlan(
            run_dir=run_dir, verdict="relaunchable",
            diagnosis=Diagnosis(cls="software", symptom="crash", summary="rank 1 crashed"),
            checkpoint=CheckpointChoice(path=None, step=None, reason="x"),
            exclusions=Exclusions(), command=list(command))


def supervise(command, planner) -> tuple[int, Supervisor]:
    sup = Supervisor(command, SuperviseOptions(watch=False, backoff_s=0, interval_s=0.05),
                     planner=planner)
    return sup.run_all(), sup


@pytest.fixture
def kill_holder(tmp_path):
    """Kill the lingering holder a test's job left behind (it runs in its own session)."""
    yield
    pid_file = tmp_path / "side" / "holder.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def written(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def test_a_run_held_by_a_live_job_is_refused_before_anything_starts(tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 0})
    lock = RunLock(str(run), "someone-else").acquire()
    try:
        before = written(run)
        planner = Planner()
        with pytest.raises(RunInUse) as e:
            supervise(cmd, planner)
        assert e.value.code == 3 and "\n" not in str(e.value)
        assert str(e.value).startswith(f"{run} is in use by a running job (pid {os.getpid()} "
                                       f"on {socket.gethostname()}, heartbeat ")
        assert not (tmp_path / "side" / "attempts").exists()  # the job was never started
        assert planner.calls == [] and written(run) == before  # no supervise.json, no events
    finally:
        lock.release()


def test_its_own_jobs_lock_left_by_a_dead_pid_is_no_obstacle(tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 3, "code": 3, "lock": "own"},
                   {"first": 4, "last": 6, "code": 0, "lock": "own"})
    planner = Planner()
    t0 = time.monotonic()
    code, sup = supervise(cmd, planner)
    assert code == 0 and len(planner.calls) == 1 and planner.holders == [None]
    assert time.monotonic() - t0 < liveness.LOCAL_GRACE_S  # no waiting for a dead pid
    assert not (run / "lock.json").exists()  # the second attempt took it over and released it


def test_a_lock_let_go_a_moment_after_the_job_is_waited_for(tmp_path, kill_holder):
    cmd, run = job(tmp_path, {"first": 1, "last": 3, "code": 3, "lock": "linger", "hold": 1.0},
                   {"first": 4, "last": 6, "code": 0})
    planner = Planner()
    code, sup = supervise(cmd, planner)
    assert code == 0 and len(planner.calls) == 1
    assert planner.holders == [None]  # diagnosed only once the lock was free


def test_another_hosts_lock_is_waited_out_for_its_lease(tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 3, "code": 3, "lock": "remote", "lease": 1.5},
                   {"first": 4, "last": 6, "code": 0, "lock": "own"})
    planner = Planner()
    t0 = time.monotonic()
    code, sup = supervise(cmd, planner)
    assert code == 0 and planner.holders == [None]
    assert time.monotonic() - t0 >= 1.0  # it waited for the lease rather than refusing


def test_a_lock_still_held_after_the_grace_is_another_jobs(tmp_path, kill_holder, monkeypatch):
    monkeypatch.setattr(liveness, "LOCAL_GRACE_S", 0.5)
    cmd, run = job(tmp_path, {"first": 1, "last": 3, "code": 3, "lock": "linger", "hold": 60})
    planner = Planner()
    with pytest.raises(RunInUse) as e:
        supervise(cmd, planner)
    holder = int((tmp_path / "side" / "holder.pid").read_text())
    assert f"(pid {holder} on " in str(e.value) and e.value.code == 3
    assert planner.calls == [] and not (run / "recover").exists()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert not [x for x in events if x["source"] == "recover"]  # no phase, no decision


def test_the_cli_says_it_in_one_line_with_exit_3(cli, tmp_path):
    cmd, run = job(tmp_path, {"first": 1, "last": 2, "code": 0})
    lock = RunLock(str(run), "someone-else").acquire()
    try:
        code, out, err = cli("recover", "supervise", "--no-watch", "--", *cmd)
        assert code == 3 and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: {run} is in use by a running job (pid {os.getpid()} ")
        assert not (tmp_path / "side" / "attempts").exists()
    finally:
        lock.release()
