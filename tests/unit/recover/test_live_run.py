"""recover refuses a run a live job holds (its real ``lock.json``, judged by runs/lock.py's own
rule): one line, exit 3, nothing written, dry run or --execute, whatever the run's files say
mid-write; a stale lock (dead pid, another host's expired lease) is no obstacle.

The live holders are real: this test process itself (`RunLock.acquire` here), or a child
process that takes the lock, beats its heartbeat and is then killed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mscale.errors import MscaleError
from mscale.recover import liveness, stages
from mscale.recover.decide import apply_plan, plan_recovery
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions
from mscale.recover.liveness import RunInUse, wait_until_free
from mscale.runs.lock import RunLock

from tests.conftest import PLANS

HOST = socket.gethostname()

HOLDER = r'''
import sys, time
from mscale.runs.lock import RunLock
run, ready, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
lock = RunLock(run, "child-job").acquire()
lock.start_heartbeat(0.2)
open(ready, "w").close()
time.sleep(hold)
lock.release()
'''
"""A job's rank 0 as far as the lock goes: take it, keep it fresh, hold it ``hold`` seconds."""


def start_holder(run: Path, tmp_path: Path, hold: float = 60.0) -> subprocess.Popen:
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(ready), str(hold)])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, "the lock holder died before taking the lock"
        assert time.monotonic() < deadline, "the lock holder never took the lock"
        time.sleep(0.02)
    return proc


@pytest.fixture
def holders():
    """Child holders started by a test; any still running are killed at its end."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def plant(run: Path, **fields) -> None:
    """A lock.json as a job elsewhere (or a dead one) left it."""
    now = time.time()
    rec = {"run_id": "old-job", "host": HOST, "pid": os.getpid(), "since": now - 30,
           "heartbeat": now, "lease_s": 60.0, "token": "t" * 32, **fields}
    (run / "lock.json").write_text(json.dumps(rec))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def tree(root: Path, job: bool = False) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and mtime: "nothing written" made checkable.
    ``job``: a live child holds the lock, whose heartbeat rewrites lock.json through a temporary
    file renamed over it (the job's own writes, not recover's): both are left out (a snapshot
    that caught ``lock.json.tmp-*`` mid-beat failed a loaded run)."""
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if job and (rel == Path("lock.json") or rel.name.startswith("lock.json.tmp-")):
            continue
        with contextlib.suppress(FileNotFoundError):
            if p.is_file():
                files[str(rel)] = (p.stat().st_size, p.stat().st_mtime_ns)
    return files


@pytest.fixture
def run(tmp_path):
    """A --local 8 run whose job may still be training: a checkpoint directory mid-write (no
    COMMITTED marker), metrics up to step 12, a start event and no stop."""
    run = tmp_path / "run"
    (run / "ckpt" / "step-000010").mkdir(parents=True)
    (run / "ckpt" / "step-000010" / "rank-00000.bin").write_bytes(b"\0" * 64)
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    argv = [sys.executable, "-c", "import sys; print('relaunched'); sys.exit(0)", "mscale",
            "train", str(run / "plan.yaml"), "--run-dir", str(run), "--local", "8"]
    now = time.time()
    start = {"kind": "start", "source": "train", "time": now - 60, "message": "training",
             "evidence": {"launcher": "local", "attempt": 1, "run_id": "local-x", "launch": {
                 "argv": argv, "cwd": str(tmp_path), "plan": str(run / "plan.yaml"),
                 "local": 8, "nodes": ["node1", "node2", "node3", "node4"], "slurm": None}}}
    (run / "events.jsonl").write_text(json.dumps(start) + "\n")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1.0, "time": now - 60 + s}) + "\n" for s in range(1, 13)))
    return run


@pytest.fixture
def faked(monkeypatch, run):
    """Stages that answer "a transient crash, resume from step 8" for a stopped run."""
    monkeypatch.setattr(stages, "diagnose", lambda d: Diagnosis(
        cls="network", symptom="crash", summary="rank 1 lost its peers", transient=True))
    monkeypatch.setattr(stages, "choose_checkpoint", lambda r, d, verify="quick":
                        CheckpointChoice(path=str(run / "ckpt/step-000008"), step=8,
                                         reason="latest"))
    monkeypatch.setattr(stages, "decide_exclusions",
                        lambda r, d, recheck=None, plan=None, **_: Exclusions())


def in_use(err: str, run: Path, pid: int, host: str = HOST) -> bool:
    """The refusal is exactly one line naming the holder and both ways forward."""
    lines = err.splitlines()
    return (len(lines) == 1
            and lines[0].startswith(f"error: {run} is in use by a running job (pid {pid} on "
                                    f"{host}, heartbeat ")
            and "s ago): recover acts on a stopped run; stop it (touch "
                f"{run}/control/halt) or wait" in lines[0])


@pytest.mark.parametrize("mode", [[], ["--execute"], ["--execute", "--no-recheck"]])
def test_a_run_this_process_holds_is_refused_with_one_line_and_nothing_written(cli, run, mode):
    lock = RunLock(str(run), "this-test").acquire()
    try:
        before = tree(run)
        code, out, err = cli("recover", str(run), *mode)
        assert code == 3 and out == "", out + err
        assert in_use(err, run, os.getpid()), err
        assert "UNRECOVERABLE" not in err and "uncommitted" not in err
        assert tree(run) == before and not (run / "recover").exists()
        code, out, err = cli("recover", str(run), *mode, "--json")
        doc = json.loads(out)
        assert code == 3 and doc["error"]["code"] == 3
        assert "is in use by a running job" in doc["error"]["message"]
        assert tree(run) == before
    finally:
        lock.release()


def test_a_child_jobs_live_lock_refuses_then_its_dead_pid_does_not(cli, run, tmp_path, holders,
                                                                  faked):
    """While the child holds the lock (pid alive, heartbeat beating) recover refuses and writes
    nothing; once it is SIGKILLed its lock.json stays on disk with a dead pid — stale by the
    lock's rule — and recover diagnoses and acts."""
    proc = start_holder(run, tmp_path)
    holders.append(proc)
    before = tree(run, job=True)
    for args in ([], ["--execute"]):
        code, out, err = cli("recover", str(run), *args)
        assert code == 3 and in_use(err, run, proc.pid), err
    assert tree(run, job=True) == before and (run / "lock.json").exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / "lock.json").exists()  # the killed job could not release it
    stale = tree(run)
    code, out, err = cli("recover", str(run))
    assert code == 0 and out.startswith(f"recover {run}: RELAUNCHABLE (exit 0)"), out + err
    assert tree(run) == stale  # a dry run writes nothing (and leaves the stale lock alone)
    code, out, err = cli("recover", str(run), "--execute")
    assert code == 0, out + err
    assert (run / "recover" / "decision-0001.json").exists()


def test_a_stale_planted_lock_with_a_dead_pid_is_no_obstacle(cli, run, faked):
    plant(run, pid=dead_pid())
    code, out, err = cli("recover", str(run), "--execute", "--json")
    assert code == 0, out + err
    doc = json.loads(out)
    assert doc["verdict"] == "relaunchable" and doc["decision"].endswith("decision-0001.json")


@pytest.mark.parametrize("age, live", [(1.0, True), (600.0, False)])
def test_another_hosts_lock_is_live_until_its_lease_runs_out(cli, run, faked, age, live):
    plant(run, host="gpu-node-17", pid=4242, heartbeat=time.time() - age, lease_s=120.0)
    before = tree(run)
    code, out, err = cli("recover", str(run))
    if live:
        assert code == 3 and in_use(err, run, 4242, "gpu-node-17"), err
        assert re.search(r"heartbeat \d+ s ago", err)  # 1 s, more on a loaded machine
    else:
        assert code == 0, out + err
    assert tree(run) == before


def test_the_mid_write_checkpoint_of_a_live_run_is_never_reported(cli, run, tmp_path, holders):
    """The trial's case with the real stages: the job is writing step-000010. Live: refused,
    never UNRECOVERABLE. Once the job is dead the same directory is what it left, and recover
    judges it (an abandoned write is a real finding then)."""
    proc = start_holder(run, tmp_path)
    holders.append(proc)
    before = tree(run, job=True)
    for args in ([], ["--execute"]):
        code, out, err = cli("recover", str(run), "--no-recheck", *args)
        assert code == 3 and "UNRECOVERABLE" not in out + err and "uncommitted" not in out + err
    assert tree(run, job=True) == before
    proc.kill()
    proc.wait()
    code, out, err = cli("recover", str(run), "--no-recheck")
    assert code != 3 and "passed over step-000010: uncommitted" in out, out + err


def test_wait_lets_a_job_that_is_ending_go_first(cli, run, tmp_path, holders, faked):
    proc = start_holder(run, tmp_path, hold=1.0)  # ends (and releases) about a second from now
    holders.append(proc)
    t0 = time.monotonic()
    code, out, err = cli("recover", str(run), "--wait", "30")
    assert code == 0, out + err
    assert time.monotonic() - t0 < 25
    proc.wait()


def test_wait_that_runs_out_still_refuses(cli, run, tmp_path, holders, faked):
    proc = start_holder(run, tmp_path)
    holders.append(proc)
    t0 = time.monotonic()
    code, out, err = cli("recover", str(run), "--wait", "0.5")
    assert code == 3 and in_use(err, run, proc.pid), err
    assert time.monotonic() - t0 >= 0.5


def test_apply_refuses_a_run_a_job_took_after_the_dry_run(run, faked):
    plan = plan_recovery(str(run))
    lock = RunLock(str(run), "started-since").acquire()
    before = tree(run)
    try:
        with pytest.raises(RunInUse) as e:
            apply_plan(plan)
        assert e.value.code == 3 and str(e.value).count("\n") == 0
        assert tree(run) == before and not (run / "recover").exists()
    finally:
        lock.release()


def test_an_unreadable_lock_file_is_bad_input_naming_it(cli, run):
    (run / "lock.json").write_text("{torn")
    code, out, err = cli("recover", str(run))
    assert code == 3 and "lock file is unreadable" in err and "lock.json" in err


def test_wait_until_free_waits_out_another_hosts_lease_only(run):
    """-1: as long as the holder's lease could keep it live (another host), on a fake clock."""
    now = [1000.0]
    plant(run, host="gpu-node-17", pid=4242, heartbeat=995.0, lease_s=20.0)
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    assert wait_until_free(str(run), -1, clock=lambda: now[0], sleep=sleep, poll_s=1.0) is None
    assert 15.0 <= now[0] - 1000.0 <= 17.0  # 995 + 20 - 1000 = 15 s left, then stale
    plant(run, host="gpu-node-17", pid=4242, heartbeat=now[0], lease_s=20.0)
    rec = wait_until_free(str(run), 2.0, clock=lambda: now[0], sleep=sleep, poll_s=1.0)
    assert rec is not None and rec.pid == 4242


def test_the_line_is_one_line_for_any_holder(run):
    plant(run)
    with pytest.raises(MscaleError) as e:
        liveness.refuse_if_live(str(run))
    assert str(e.value) == e.value.message and "\n" not in e.value.message
    assert re.search(rf"\(pid {os.getpid()} on {re.escape(HOST)}, heartbeat \d+ s ago\)",
                     e.value.message)
