"""One job per run directory: a lock a crashed job cannot leave stuck, run ids and attempts.

Two jobs started on one ``--run-dir`` would interleave their metrics, events and checkpoints
silently. Rank 0 of a job holds ``RUN/lock.json`` for as long as it runs::

    with RunLock(run.root, new_run_id()) as lock:   # refuses (MscaleError, exit 3) if held
        attempt = next_attempt(run.root)            # read under the lock
        ...
        lock.check()                                # once a step: raises if the lock was lost

The record names the holder (run id, host, pid and the pid's start time, since) and carries a
``heartbeat`` time that a thread rewrites every ``lease_s / 4`` seconds. A lock is stale, and is
taken over, when its holder's process is gone (same host: the pid does not exist, or belongs to a
process started later than the holder), or when its heartbeat is older than the holder's lease
(another host: a crashed node cannot be asked).

Locally the record is written to a temp file and hard-linked to ``lock.json``: the link fails if
the lock exists, so creation is exclusive and the file is never seen half-written (where hard
links are not supported, ``O_EXCL`` creation). A stale lock is
renamed aside and checked to be the one judged stale before it is deleted, so two jobs taking
over the same dead lock cannot both win. Object stores have no exclusive create: the lease there
is best effort (write the record, wait ``settle_s``, read it back, and own it only if it is still
ours), and the heartbeat re-checks ownership, so a lost race shows as `check` raising.

The heartbeat thread learns of a takeover only at its next beat: a job stopped past its lease
(SIGSTOP, a hung mount, a suspended VM) runs on for up to ``lease_s / 4`` first. What must never
happen in a run the job lost, a checkpoint commit, reads the record itself (`ownership_lost`).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from typing import Callable

from fsspec.implementations.local import LocalFileSystem
from pydantic import Field, ValidationError

from mscale.config.base import StrictModel
from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path, read_jsonl, write_all, write_bytes_atomic
from mscale.runs.rundir import RunDir

LOCK_HELD_ENV = "MSCALE_RUN_LOCK_HELD"
"""Set by the --local launcher, which holds the run directory's lock for its workers (they then
do not take it themselves)."""

DEFAULT_LEASE_S = 120.0
"""Seconds without a heartbeat after which a lock held from another host is stale."""


class LockRecord(StrictModel):
    """``lock.json``: who holds the run directory."""

    schema_version: int = 1
    run_id: str
    """The holder's run id (`new_run_id`)."""
    host: str
    """Host name of the holding process."""
    pid: int = Field(gt=0)
    """Process id of the holder on ``host``."""
    pid_start: int | None = None
    """The holder's start time in clock ticks since boot (Linux), to tell a reused pid."""
    since: float
    """Unix time the lock was taken."""
    heartbeat: float
    """Unix time the holder last said it was alive."""
    lease_s: float = Field(gt=0)
    """Heartbeat age after which the lock is stale."""
    token: str
    """Random; tells two acquisitions by the same process apart."""


def new_run_id() -> str:
    """A sortable, unique id for one job: UTC start time and a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def run_id_from_env() -> str:
    """The launcher's id for this launch, read from the environment: mscale --local sets
    MSCALE_RUN_ID; SLURM has a job (and step) id; torchrun a rendezvous id. Otherwise a fresh
    one, kept for the process so that it names its launch once (only rank 0 uses it: torchrun's
    static rendezvous, ``TORCHELASTIC_RUN_ID=none``, gave rank 0's start and stop events two
    ids, and recover counted the stop as a second attempt). Kept in this module, not the
    environment, which child processes and later tests would inherit."""
    e = os.environ
    if e.get("MSCALE_RUN_ID"):
        return e["MSCALE_RUN_ID"]
    if e.get("SLURM_JOB_ID"):
        step = e.get("SLURM_STEP_ID")
        return f"slurm-{e['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    if e.get("TORCHELASTIC_RUN_ID") and e["TORCHELASTIC_RUN_ID"] != "none":
        return f"torchrun-{e['TORCHELASTIC_RUN_ID']}"
    return _GENERATED.setdefault(os.getpid(), new_run_id())


_GENERATED: dict[int, str] = {}
"""`run_id_from_env`'s generated id, by process (a fork gets its own)."""


def next_attempt(run_dir: str) -> int:
    """1 for a fresh run directory, n+1 after n earlier ``start`` events of ``train``.

    Write it (and the run id) into the new start event's ``evidence`` so that two starts are
    distinguishable; call it while holding the `RunLock` so that two jobs cannot draw the same.
    Earlier starts without an ``attempt`` field count as one each.
    """
    starts = [e for e in read_jsonl(RunDir(run_dir).events)
              if e.get("kind") == "start" and e.get("source", "train") == "train"]
    numbered = [a for e in starts if isinstance(a := (e.get("evidence") or {}).get("attempt"), int)]
    return max([len(starts), *numbered]) + 1


def _pid_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def stale_reason(rec: LockRecord, now: float, host: str | None = None) -> str | None:
    """Why the lock ``rec`` may be taken over, or None while its holder may be alive."""
    if rec.host == (host or socket.gethostname()):
        if not _pid_alive(rec.pid):
            return f"process {rec.pid} no longer exists"
        start = _pid_start(rec.pid)
        if rec.pid_start is not None and start is not None and start != rec.pid_start:
            return f"pid {rec.pid} now belongs to another process"
    age = now - rec.heartbeat
    if age > rec.lease_s:
        return f"no heartbeat for {age:.0f} s (lease {rec.lease_s:.0f} s)"
    return None


def live_holder(run_dir: str, now: float | None = None) -> LockRecord | None:
    """The lock record of the job holding ``run_dir`` while that job may be alive (the rule of
    `stale_reason`, the one `RunLock.acquire` applies); None when the directory is not locked or
    its holder is gone. For tools that must not act on a run a job is using (recover, ckpt
    convert into a run). An unreadable lock file raises the MscaleError `RunLock` raises."""
    rec = RunLock(run_dir, "reader").holder()
    if rec is None or stale_reason(rec, time.time() if now is None else now) is not None:
        return None
    return rec


def ownership_lost(run_dir: str, run_id: str, token: str | None = None) -> str | None:
    """Why the job ``run_id`` no longer holds ``run_dir`` (another job took its lock over, or the
    lock file is gone), or None while it does: `RunLock.holder` read now, one small file, so a job
    stopped past its lease learns it before its heartbeat thread has run again. ``token``: the
    acquisition's, where this process took the lock itself (a --local worker knows only its
    launcher's run id, `LOCK_HELD_ENV`). Past its lease a holder still owns the directory until
    another job takes the lock: staleness is not loss."""
    rec = RunLock(run_dir, run_id).holder()
    if rec is None:
        return f"run lock lost: {RunDir(run_dir).lock} was removed"
    if rec.run_id == run_id and token in (None, rec.token):
        return None
    return (f"run lock taken over by run {rec.run_id} (pid {rec.pid} on {rec.host}) "
            f"at {_when(rec.since)}")


def holder_text(rec: LockRecord, now: float | None = None) -> str:
    """``pid 4242 on host-a, heartbeat 2 s ago``: who holds a lock, for one-line refusals."""
    age = max(0.0, (time.time() if now is None else now) - rec.heartbeat)
    return f"pid {rec.pid} on {rec.host}, heartbeat {age:.0f} s ago"


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class RunLock:
    """The lock on one run directory (module docstring). Usable as a context manager, which
    acquires, keeps the heartbeat going on a daemon thread, and releases."""

    def __init__(self, run_dir: str, run_id: str, lease_s: float = DEFAULT_LEASE_S,
                 settle_s: float = 0.5, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.url = RunDir(run_dir).lock
        self.fs, self.path = fs_and_path(self.url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.run_id, self.lease_s, self.settle_s = run_id, lease_s, settle_s
        self.clock, self.sleep = clock, sleep
        self.record: LockRecord | None = None
        self.lost: MscaleError | None = None
        """Set by the heartbeat thread when another job took the lock; `check` raises it."""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- reading ------------------------------------------------------------------------------
    def holder(self) -> LockRecord | None:
        """The current lock record, or None when the directory is not locked."""
        return self._read(self.path)

    def _read(self, path: str) -> LockRecord | None:
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            return LockRecord.model_validate(json.loads(raw))
        except (ValueError, ValidationError):
            raise MscaleError("the run directory's lock file is unreadable", file=self.url,
                              fix=f"if no job is using this run directory, remove {self.url}") from None

    def _busy(self, rec: LockRecord, verb: str = "is in use") -> MscaleError:
        age = self.clock() - rec.heartbeat
        return MscaleError(
            f"the run directory {verb}: run {rec.run_id} on host {rec.host}, pid {rec.pid}, "
            f"since {_when(rec.since)} (last heartbeat {age:.0f} s ago)", file=self.url,
            fix=f"wait for that job to end, or stop it; if you are sure it is dead, remove {self.url}")

    # -- acquiring ----------------------------------------------------------------------------
    def acquire(self, wait_s: float = 0.0) -> "RunLock":
        """Take the lock, or raise MscaleError naming the holder and the fix.

        ``wait_s`` > 0 keeps trying that long (e.g. a restart on another host waiting out the
        lease of the job it replaces).
        """
        deadline = self.clock() + wait_s
        while True:
            try:
                self._try_acquire()
                return self
            except MscaleError:
                if self.clock() >= deadline:
                    raise
            self.sleep(min(5.0, self.lease_s / 10))

    def _try_acquire(self) -> None:
        now = self.clock()
        mine = LockRecord(run_id=self.run_id, host=socket.gethostname(), pid=os.getpid(),
                          pid_start=_pid_start(os.getpid()), since=now, heartbeat=now,
                          lease_s=self.lease_s, token=uuid.uuid4().hex)
        for _ in range(3):  # a holder that vanishes or is broken in between: look again
            held = self.holder()
            if held is not None:
                if stale_reason(held, now) is None:
                    raise self._busy(held)
                if self.local and not self._break_local(held):
                    continue
            if self._create(mine):
                self.record, self.lost = mine, None
                return
        held = self.holder()
        raise self._busy(held) if held else MscaleError(
            "could not take the run directory's lock (it changed hands repeatedly)", file=self.url,
            fix="make sure only one job is started on this run directory, then retry")

    def _create(self, mine: LockRecord) -> bool:
        data = mine.model_dump_json(indent=2).encode()
        if self.local:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.new-{mine.token}"
            write_bytes_atomic(tmp, data)
            try:
                os.link(tmp, self.path)  # fails if the lock exists: exclusive, never half-written
                return True
            except FileExistsError:
                return False
            except OSError:  # no hard links here (some FUSE/SMB mounts): plain O_EXCL
                return self._create_excl(data)
            finally:
                os.unlink(tmp)
        write_bytes_atomic(self.url, data)  # best effort: the last writer wins, so read back
        self.sleep(self.settle_s)
        back = self.holder()
        if back is None or back.token != mine.token:
            if back is not None:
                raise self._busy(back, "was taken at the same time by another job")
            return False
        return True

    def _create_excl(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _break_local(self, stale: LockRecord) -> bool:
        """Remove the stale lock ``stale``; False if what was there was something else."""
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # someone else removed it: try to create
        try:
            if self._read(aside) == stale:
                return True
            try:  # a fresh lock was moved by mistake: put it back unless another took its place
                os.link(aside, self.path)
            except FileExistsError:
                pass
            return False
        finally:
            os.unlink(aside)

    # -- holding ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Renew the heartbeat; raise MscaleError if another job has taken the lock."""
        if self.record is None:
            raise MscaleError("refresh of a run-directory lock that is not held", file=self.url)
        held = self.holder()
        if held is None or held.token != self.record.token:
            self.record = None
            self.lost = (self._busy(held, "was taken over by another job") if held else
                         MscaleError("this job's run-directory lock was removed", file=self.url,
                                     fix="make sure only one job uses this run directory"))
            raise self.lost
        rec = self.record.model_copy(update={"heartbeat": self.clock()})
        data = rec.model_dump_json(indent=2).encode()
        write_bytes_atomic(self.url, data)
        self.record = rec

    def check(self) -> None:
        """Raise the MscaleError the heartbeat thread recorded if the lock was lost (no I/O)."""
        if self.lost is not None:
            raise self.lost

    def start_heartbeat(self, interval_s: float | None = None) -> None:
        """Refresh every ``interval_s`` (default a quarter of the lease) on a daemon thread."""
        interval = interval_s or self.lease_s / 4
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    self.refresh()
                except MscaleError:
                    if self.lost is not None:
                        return  # taken over or removed: the training loop sees it in check()
                    continue  # a write that failed (a full disk raises DiskFullError): retried
                except Exception:  # a transient I/O error: the next beat retries
                    continue

        self._beat = threading.Thread(target=beat, name="mscale-run-lock", daemon=True)
        self._beat.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this job's (idempotent)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.record is None:
            return
        held = self.holder()
        if held is not None and held.token == self.record.token:
            self.fs.rm_file(self.path)
        self.record = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        self.start_heartbeat()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
