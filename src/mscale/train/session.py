"""Rank 0's appends to metrics.jsonl and events.jsonl, which must never crash the job.

A full disk (or quota) while appending a record is a reason to stop, not a traceback in the
middle of a collective: the other ranks would wait in the next one until the timeout. The journal
catches it, remembers it, and the loop puts it into the step's control all-reduce, so every rank
stops at the same step boundary and the process exits with one line saying the disk is full.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel

from mscale.errors import MscaleError
from mscale.runs.atomic import read_jsonl
from mscale.runs.rundir import RunDir
from mscale.topology.env import LaunchEnv


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, MscaleError) and bool(getattr(exc, "disk_full", False))


class Journal:
    """Appends records for rank 0; other ranks' appends are no-ops."""

    def __init__(self, run: RunDir, enabled: bool):
        self.run, self.enabled = run, enabled
        self.failure: BaseException | None = None
        """The first append that failed because the disk is full (then appends stop)."""
        self._lock = threading.Lock()  # the checkpoint writer thread emits events too

    def append(self, url: str, record: BaseModel) -> None:
        if not self.enabled or self.failure is not None:
            return
        with self._lock:
            try:
                self.run.append_record(url, record)
            except Exception as exc:  # noqa: BLE001 - only a full disk is held back
                if not is_disk_full(exc):
                    raise
                self.failure = exc


@dataclass
class RunSession:
    """This process's view of the run directory for one attempt of the job."""

    run: RunDir
    journal: Journal
    run_id: str
    """Identifies one launch of the job (the launcher's, SLURM's job id, or made here)."""
    attempt: int
    """1 for the first launch into this run directory, then 2, 3, ... (read from the start
    events already there), so two start events are never confused."""


def run_id_from_env(env: LaunchEnv) -> str:
    """The launcher's id for this launch: mscale --local sets MSCALE_RUN_ID; SLURM has a job (and
    step) id; torchrun a rendezvous id. Otherwise a fresh one (only rank 0 uses it)."""
    e = os.environ
    if e.get("MSCALE_RUN_ID"):
        return e["MSCALE_RUN_ID"]
    if e.get("SLURM_JOB_ID"):
        step = e.get("SLURM_STEP_ID")
        return f"slurm-{e['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    if e.get("TORCHELASTIC_RUN_ID") and e["TORCHELASTIC_RUN_ID"] != "none":
        return f"torchrun-{e['TORCHELASTIC_RUN_ID']}"
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def previous_starts(run: RunDir) -> int:
    """How many start events the run directory already holds."""
    try:
        records = read_jsonl(run.events)
    except MscaleError:
        return 0
    return sum(1 for r in records if r.get("kind") == "start" and r.get("source") == "train")


def open_session(run: RunDir, env: LaunchEnv) -> RunSession:
    rank0 = env.rank == 0
    attempt = previous_starts(run) + 1 if rank0 else 0
    return RunSession(run, Journal(run, enabled=rank0), run_id_from_env(env), attempt)
