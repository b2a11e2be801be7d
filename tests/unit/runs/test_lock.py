"""The run-directory lock: one job at a time, and a crashed job never leaves it stuck."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from mscale.config.records import Event
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.lock import LockRecord, RunLock, new_run_id, next_attempt
from mscale.runs.rundir import RunDir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant(url_dir: str, **fields) -> None:
    """Write a lock.json as another job would have left it."""
    now = time.time()
    rec = {"run_id": "old-run", "host": socket.gethostname(), "pid": os.getpid(), "since": now,
           "heartbeat": now, "lease_s": 60.0, "token": "t" * 32, **fields}
    RunDir(url_dir).create()
    from mscale.runs.atomic import write_text_atomic

    write_text_atomic(RunDir(url_dir).lock, json.dumps(rec))


def _run_dir(tmp_path, proto: str) -> str:
    return str(tmp_path / "run") if proto == "file" else f"memory://lock-{uuid.uuid4().hex}/run"


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_a_live_lock_is_refused_naming_the_holder(tmp_path, proto):
    run = _run_dir(tmp_path, proto)
    first = RunLock(run, "run-a", settle_s=0).acquire()
    with pytest.raises(MscaleError) as info:
        RunLock(run, "run-b", settle_s=0).acquire()
    err = info.value
    assert err.code == EXIT_BAD_INPUT
    assert "run-a" in err.message and socket.gethostname() in err.message
    assert f"pid {os.getpid()}" in err.message and "since" in err.message
    assert "lock.json" in err.fix and "wait" in err.fix
    first.release()
    RunLock(run, "run-b", settle_s=0).acquire().release()  # free again once released


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_a_lock_whose_process_is_gone_is_taken_over(tmp_path, proto):
    run = _run_dir(tmp_path, proto)
    _plant(run, pid=_dead_pid())
    lock = RunLock(run, "new-run", settle_s=0).acquire()
    assert lock.holder().run_id == "new-run"


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    run = str(tmp_path / "run")
    _plant(run, pid=os.getpid(), pid_start=1)  # our pid, but a process started at boot
    assert RunLock(run, "new-run").acquire().holder().run_id == "new-run"


def test_another_hosts_lock_is_stale_only_after_its_lease(tmp_path):
    run = str(tmp_path / "run")
    _plant(run, host="elsewhere-node", pid=1, heartbeat=time.time() - 10)
    with pytest.raises(MscaleError, match="elsewhere-node"):
        RunLock(run, "new-run").acquire()
    _plant(run, host="elsewhere-node", pid=1, heartbeat=time.time() - 3600)
    assert RunLock(run, "new-run").acquire().holder().run_id == "new-run"


def test_acquire_can_wait_for_the_holder_to_go(tmp_path):
    run = str(tmp_path / "run")
    holder = RunLock(run, "old").acquire()
    waited = []

    def fake_sleep(s):
        waited.append(s)
        holder.release()

    lock = RunLock(run, "new", sleep=fake_sleep).acquire(wait_s=60)
    assert waited and lock.holder().run_id == "new"


def test_refresh_moves_the_heartbeat_and_notices_a_takeover(tmp_path):
    run = str(tmp_path / "run")
    t = [1000.0]
    lock = RunLock(run, "mine", clock=lambda: t[0]).acquire()
    t[0] = 1030.0
    lock.refresh()
    assert lock.holder().heartbeat == 1030.0
    _plant(run, run_id="thief")  # someone removed ours and took it
    with pytest.raises(MscaleError, match="taken over"):
        lock.refresh()
    with pytest.raises(MscaleError, match="thief"):
        lock.check()
    lock.release()
    assert RunLock(run, "x").holder().run_id == "thief"  # release never deletes another's lock


def test_the_heartbeat_thread_keeps_the_lock_fresh(tmp_path):
    run = str(tmp_path / "run")
    with RunLock(run, "mine", lease_s=0.04) as lock:  # a beat every 0.01 s
        before = lock.holder().heartbeat
        deadline = time.time() + 10
        while lock.holder().heartbeat == before and time.time() < deadline:
            time.sleep(0.01)
        assert lock.holder().heartbeat > before
        lock.check()
    assert not os.path.exists(RunDir(run).lock)


def test_the_heartbeat_outlives_a_full_disk(tmp_path, monkeypatch):
    """A transient ENOSPC in a beat (DiskFullError, an MscaleError) ended the heartbeat thread
    with the lock not lost: the job trained on while, a lease later, recover and a second train
    took the run for free. A failed write is retried at the next beat."""
    import mscale.runs.lock as lock_mod
    from mscale.runs.atomic import DiskFullError

    run = str(tmp_path / "run")
    real, fails = lock_mod.write_bytes_atomic, [0]

    def flaky(url, data):
        if fails[0] < 3:
            fails[0] += 1
            raise DiskFullError("No space left on device", file=url)
        real(url, data)

    with RunLock(run, "mine", lease_s=0.04) as lock:
        before = lock.holder().heartbeat
        monkeypatch.setattr(lock_mod, "write_bytes_atomic", flaky)
        deadline = time.time() + 10
        while lock.holder().heartbeat == before and time.time() < deadline:
            time.sleep(0.01)
        assert fails[0] == 3 and lock.holder().heartbeat > before
        lock.check()


def test_breaking_a_stale_lock_never_removes_a_fresh_one(tmp_path):
    """Two jobs judged the same dead lock stale; one already replaced it with its own."""
    run = str(tmp_path / "run")
    _plant(run, pid=_dead_pid())
    lock = RunLock(run, "late")
    judged = lock.holder()
    _plant(run, run_id="early", token="e" * 32)  # the other job won the takeover
    assert lock._break_local(judged) is False
    assert lock.holder().run_id == "early"
    assert sorted(os.listdir(run)) == ["ckpt", "control", "lock.json", "logs"]  # nothing aside


def test_object_store_lease_lost_race_is_refused(tmp_path):
    """No exclusive create on object stores: whoever reads back someone else's record loses."""
    run = f"memory://lock-{uuid.uuid4().hex}/run"
    lock = RunLock(run, "slow", sleep=lambda s: _plant(run, run_id="fast", token="f" * 32))
    with pytest.raises(MscaleError, match="fast"):
        lock.acquire()
    assert lock.record is None


def test_an_unreadable_lock_names_the_file_and_fix(tmp_path):
    run = str(tmp_path / "run")
    os.makedirs(run)
    open(RunDir(run).lock, "w").write("{not json")
    with pytest.raises(MscaleError, match="unreadable") as info:
        RunLock(run, "x").acquire()
    assert "remove" in info.value.fix


def test_lock_record_rejects_a_nonpositive_pid():
    with pytest.raises(ValueError):
        LockRecord(run_id="r", host="h", pid=0, since=0, heartbeat=0, lease_s=1, token="t")


def test_run_ids_are_unique_and_attempts_count_starts(tmp_path):
    assert len({new_run_id() for _ in range(100)}) == 100
    run = RunDir(str(tmp_path / "run"))
    assert next_attempt(run.root) == 1
    run.append_record(run.events, Event(source="train", kind="start"))  # an older run, no field
    run.append_record(run.events, Event(source="train", kind="stop"))
    assert next_attempt(run.root) == 2
    run.append_record(run.events, Event(source="train", kind="start", evidence={"attempt": 5}))
    assert next_attempt(run.root) == 6


def test_without_hard_links_creation_is_still_exclusive(tmp_path, monkeypatch):
    from mscale.runs import lock as lock_module

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(lock_module.os, "link", no_links)
    run = str(tmp_path / "run")
    RunLock(run, "first").acquire()
    with pytest.raises(MscaleError, match="first"):
        RunLock(run, "second").acquire()
    assert sorted(os.listdir(run)) == ["lock.json"]  # no temp files left behind


def test_live_holder_is_the_acquire_rule_read_only(tmp_path):
    """`live_holder` answers what `acquire` would: a held lock's record while its holder may be
    alive, None once it is stale (dead pid; another host's lapsed lease) or absent; it writes
    nothing and takes nothing over."""
    from mscale.runs.lock import holder_text, live_holder

    run = str(tmp_path / "run")
    assert live_holder(run) is None
    lock = RunLock(run, "job-a").acquire()
    rec = live_holder(run)
    assert rec is not None and rec.run_id == "job-a" and rec.pid == os.getpid()
    assert holder_text(rec, rec.heartbeat + 2.4) == \
        f"pid {os.getpid()} on {socket.gethostname()}, heartbeat 2 s ago"
    lock.release()
    assert live_holder(run) is None
    _plant(run, pid=_dead_pid())
    before = (tmp_path / "run" / "lock.json").read_bytes()
    assert live_holder(run) is None
    assert (tmp_path / "run" / "lock.json").read_bytes() == before  # left for a taker
    _plant(run, host="elsewhere", pid=4242, heartbeat=time.time() - 5, lease_s=60.0)
    assert live_holder(run).host == "elsewhere"
    assert live_holder(run, now=time.time() + 120) is None


def test_a_generated_run_id_is_the_processs_one_launch(monkeypatch):
    """torchrun's static rendezvous (TORCHELASTIC_RUN_ID=none) gave rank 0's start and stop
    events two ids: recover read the stop as another attempt (helper-46)."""
    from mscale.runs.lock import run_id_from_env

    for var in ("MSCALE_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    first = run_id_from_env()
    assert run_id_from_env() == first


def test_ownership_lost_tells_this_jobs_lock_from_anyone_elses(tmp_path):
    """One read of lock.json, before a checkpoint commits: the same run id holds it (with this
    acquisition's token, where known), or the reason names who took it and when."""
    from mscale.runs.lock import ownership_lost

    run = str(tmp_path / "run")
    mine = RunLock(run, "job-a").acquire()
    token = mine.record.token
    assert ownership_lost(run, "job-a", token) is None
    assert ownership_lost(run, "job-a") is None  # a --local worker: the launcher's run id only
    rec = mine.holder()
    mine.refresh()  # a beat of its own heartbeat changes nothing
    assert ownership_lost(run, "job-a", token) is None
    later = rec.heartbeat + 3600  # past job-a's lease for a taker with this clock
    taker = RunLock(run, "job-b", clock=lambda: later).acquire()
    why = ownership_lost(run, "job-a", token)
    assert why.startswith(f"run lock taken over by run job-b (pid {os.getpid()} on "
                          f"{socket.gethostname()}) at ") and why.endswith(" UTC")
    taker.release()
    assert ownership_lost(run, "job-a", token) == f"run lock lost: {run}/lock.json was removed"
    again = RunLock(run, "job-a").acquire()  # the same run id again (a requeued SLURM job)
    assert ownership_lost(run, "job-a", token).startswith("run lock taken over by run job-a")
    assert ownership_lost(run, "job-a", again.record.token) is None
