"""Rank 0's appends to metrics.jsonl and events.jsonl, which must never crash the job.

A full disk (or quota) while appending a record is a reason to stop, not a traceback in the
middle of a collective: the other ranks would wait in the next one until the timeout. The journal
catches it, remembers it, and the loop puts it into the step's control all-reduce, so every rank
stops at the same step boundary and the process exits with one line saying the disk is full.
"""

from __future__ import annotations

import contextlib

import errno
import json
import os
import time
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from pydantic import BaseModel

from mscale.config.records import DataSkips
from mscale.errors import MscaleError
from mscale.runs.atomic import is_disk_full
from mscale.urls import fs_and_path
from mscale.runs.history import PlanChange, plan_change_of, write_plan
from mscale.distributed import flight
from mscale.runs.lock import (LOCK_HELD_ENV, RunLock, next_attempt, ownership_lost,
                              run_id_from_env)
from mscale.runs.rundir import RunDir
from mscale.topology.env import LaunchEnv, node_name
from mscale.topology.placement import placement_record
from mscale.train.failure import ReportedFailure, report_failure


T = TypeVar("T")


UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ESTALE)
"""What else a run directory's filesystem says when it can no longer be written: remounted
read-only, permissions changed under the job, an I/O error, a stale network handle."""


def is_unwritable(exc: BaseException) -> bool:
    """A failed append that is the filesystem's doing, not the code's: a full disk, or
    `UNWRITABLE`. Rank 0 then stops every rank at the step boundary with one line, as for a
    full disk, rather than crashing (a crash reads as a software fault on rank 0's node)."""
    return is_disk_full(exc) or (isinstance(exc, OSError) and exc.errno in UNWRITABLE)


class Journal:
    """Appends records for rank 0; other ranks' appends are no-ops."""

    def __init__(self, run: RunDir, enabled: bool):
        self.run, self.enabled = run, enabled
        self.failure: BaseException | None = None
        """The first append that failed because the filesystem could not take it (full,
        read-only, no permission, an I/O error: `is_unwritable`); then appends stop."""
        self._lock = threading.Lock()  # the checkpoint writer thread emits events too

    def append(self, url: str, record: BaseModel) -> None:
        if not self.enabled or self.failure is not None:
            return
        with self._lock:
            try:
                self.run.append_record(url, record)
            except Exception as exc:  # noqa: BLE001 - only the filesystem's failures are held
                if not is_unwritable(exc):
                    raise
                self.failure = exc



@dataclass
class RunSession:
    """This process's view of the run directory for one attempt of the job."""

    run: RunDir
    journal: Journal
    run_id: str
    """Identifies one launch of the job (the launcher's, SLURM's job id, or made here)."""
    attempt: int = 0
    """1 for the first launch into this run directory, then 2, 3, ... (from the start events
    already there, read under the lock), so two start events are never confused. Rank 0 reads
    it; the others learn it from `share_start` (0 until then)."""
    lock: RunLock | None = None
    token: str | None = None
    """The lock's token when rank 0 took it itself (kept: a lost `RunLock` forgets its record)."""
    changed_plan: object | None = None
    """The plan `claim` accepted as a change of the run's plan, not yet written (rank 0)."""

    def claim(self, plan, allow_batch_change: bool = False,
              allow_data_change: bool = False) -> PlanChange:
        """Rank 0: lock the run directory (unless the launcher holds it), check the plan against
        the run's (refusing another model or recipe; a new global batch only when allowed; any
        change of a plan no step trained with), record it when the run has none, it moves the
        ranks (another layout, cluster or placement) or the run's never trained, and number
        this attempt."""
        self.run.create()
        if not os.environ.get(LOCK_HELD_ENV):
            self.lock = RunLock(self.run.root, self.run_id).acquire()
            self.lock.start_heartbeat()
            self.token = self.lock.record.token
        change = plan_change_of(self.run, plan, allow_batch_change=allow_batch_change,
                                allow_data_change=allow_data_change)
        if change.kind == "new" or change.relayout or (change.kind == "changed"
                                                        and change.untrained):
            # recover (and its diagnosis: which node ran a rank) reads plan.yaml as the plan the
            # failed attempt ran: a start on recover's smaller plan that fails in its build or
            # resume must not leave the old plan there, whose nodes that recovery kept out; nor
            # may a fixed plan replacing one that never trained leave that one (its model)
            change = write_plan(self.run, plan, change)
        elif change.kind == "changed":  # written by `write_changed_plan`, once training starts
            self.changed_plan = plan
        self.attempt = next_attempt(self.run.root)
        return change

    def write_changed_plan(self) -> str | None:
        """Rank 0, once the start goes ahead (a step will train): write the changed plan that
        `claim` accepted into the run's plan history and plan.yaml; returns the history entry.
        Written earlier, a start that failed or had nothing to train (``--steps 4`` at step 10)
        left its plan as the run's, and the next start reported it as a change."""
        plan, self.changed_plan = self.changed_plan, None
        if plan is None:
            return None
        return write_plan(self.run, plan, PlanChange(kind="changed")).history

    def trouble(self, save_due: bool = False) -> str | None:
        """Why rank 0 cannot go on, if it cannot: the disk is full, or the lock was lost.
        ``save_due``: a save starts at this boundary, so the lock file is read now (`lock_lost`),
        not left to the heartbeat. A job stopped past its lease (SIGSTOP) wakes with its
        heartbeat not yet run; had it started a save, every rank would open ``step-N``'s shard
        files for writing, truncating those of a ``step-N`` the run's new owner committed."""
        failure = self.journal.failure
        if failure is not None:
            first = str(failure).splitlines()[0]
            fix = "free space" if is_disk_full(failure) else \
                "make the run directory's filesystem writable again"
            return f"{first}; this stop saves no checkpoint; {fix}, then resume"
        lost = None if self.lock is None or self.lock.lost is None else \
            str(self.lock.lost).splitlines()[0]
        if lost is None and save_due:
            with contextlib.suppress(Exception):  # unreadable is no takeover: commit asks again
                lost = self.lock_lost()
        if lost is not None:
            return f"{lost}; stopping so two jobs do not interleave"
        return None

    def lock_lost(self) -> str | None:
        """Why this job no longer holds its run directory, or None while it does (one read of
        lock.json, `runs.lock.ownership_lost`). Rank 0's checkpointer asks before each commit: a
        job stopped past its lease (SIGSTOP, a hung mount) may commit before its heartbeat
        notices, and under srun or torchrun nothing else stops it. Under a --local launcher the
        lock is the launcher's, held under the run id it passes in ``LOCK_HELD_ENV``."""
        held_for = os.environ.get(LOCK_HELD_ENV)
        return ownership_lost(self.run.root, held_for or self.run_id,
                              None if held_for else self.token)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def agree_on_rank0(fn: Callable[[], T], rank: int,
                   report: Callable[[Exception], Exception] | None = None) -> T | None:
    """Run ``fn`` on rank 0 and tell every rank whether it succeeded (one broadcast). The others
    raise a short MscaleError pointing at rank 0's error. Rank 0 re-raises its own, or, given
    ``report``, reports it *before* the broadcast and raises what ``report`` returns (the loop's:
    `failure.report_failure`, then `failure.ReportedFailure`): a peer that exits first would
    otherwise get rank 0 stopped by a --local launcher before it had said why."""
    result, error, ok = None, None, torch.ones(1)
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the others know
            error, ok = exc, torch.zeros(1)
    if error is not None and report is not None:
        error = report(error)
    if dist.is_initialized():
        dist.broadcast(ok, src=0)
    if error is not None:
        raise error
    if not ok.item():
        raise MscaleError("rank 0 could not start the run (its error says why)",
                          fix="see rank 0's error line or logs/rank0.error.json")
    return result


@dataclass(frozen=True)
class Start:
    """What rank 0 found in the run directory when it took it, known on every rank."""

    change: PlanChange | None
    """How the plan differs from the last attempt's (rank 0 only; None elsewhere)."""
    skips: DataSkips
    """RUN/data_skip.json: data windows the loader passes over (train/data.py)."""


def claim_start(s: RunSession, plan, env: LaunchEnv, allow_batch_change: bool = False,
                allow_data_change: bool = False) -> Start:
    """Rank 0 takes the run directory (lock, plan history, attempt number, data skips) before
    the engine is built, which needs the attempt and the skips; every rank learns whether it
    could, so a refused start ends all of them at once instead of leaving the others waiting in
    their first collective. Rank 0's own failure is reported before its peers hear of it."""
    node = node_name(env, plan)
    claimed = agree_on_rank0(lambda: (s.claim(plan.model_copy(
        update={"placement": plan.placement or placement_record(plan)}),
        allow_batch_change=allow_batch_change, allow_data_change=allow_data_change),
        read_data_skips(s.run)), env.rank,
        report=lambda exc: ReportedFailure(report_failure(s.run, 0, node, exc)))
    change, skips = claimed or (None, None)
    s.attempt, skips = share_start(s.attempt, skips, env.rank)
    flight.note_attempt(s.attempt)  # a dump of this process names the attempt it belongs to
    flight.point_torch_dump(s.run.logs, s.attempt)  # NCCL's own, on a timeout
    return Start(change, skips)


def record_changed_plan(s: RunSession, plan, env: LaunchEnv) -> str | None:
    """Collective, once the start goes ahead: rank 0 writes the changed plan `claim` accepted
    (`RunSession.write_changed_plan`); a failure to write it stops every rank, reported first.
    Returns the history entry written (rank 0; None elsewhere, or when nothing was left)."""
    return agree_on_rank0(s.write_changed_plan, env.rank, report=lambda exc: ReportedFailure(
        report_failure(s.run, 0, node_name(env, plan), exc)))


def read_data_skips(run: RunDir) -> DataSkips:
    """``RUN/data_skip.json`` (written by `mscale recover` on a rollback); none skipped when it
    is absent. A damaged file stops the start (exit 3) naming it: training over the data window
    that diverged, or past data nobody meant to skip, must not happen silently."""
    fs, path = fs_and_path(run.data_skip)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return DataSkips()
    try:
        return DataSkips.model_validate(json.loads(raw))
    except ValueError as e:  # pydantic's ValidationError is a ValueError, as is bad JSON
        raise MscaleError(f"unreadable data skip file: {str(e).splitlines()[0]}",
                          file=run.data_skip, fix="repair it (each entry needs after_step >= 0 "
                          "and skip_steps >= 1) or remove it to skip nothing") from None


def share_start(attempt: int, skips: DataSkips | None, rank: int) -> tuple[int, DataSkips]:
    """Rank 0's attempt number and data skips on every rank (one JSON broadcast): the fault
    hooks and the data order must be the same decision everywhere."""
    doc = from_rank0({"attempt": attempt,
                      "skips": skips.model_dump(mode="json") if skips else None}, rank)
    return doc["attempt"], DataSkips.model_validate(doc["skips"] or {})


def from_rank0(obj, rank: int):
    """Rank 0's JSON-able ``obj`` on every rank (collective on the default group)."""
    from mscale.ckpt.commit import broadcast_json

    if not dist.is_initialized():
        return obj
    return broadcast_json(obj if rank == 0 else None, dist.group.WORLD)


def launch_record(launch: dict | None, plan, env: dict | None = None,
                  launcher: str | None = None) -> dict:
    """``evidence["launch"]`` of the start event: how to launch this job again (docs/train.md).
    ``launch`` is what the CLI recorded (argv, cwd, plan, local); nodes and SLURM are added.
    Under srun (``launcher`` ``slurm``) the nodes are the step's own, in rank order: recover
    names a rank's node and re-checks the job's nodes by them, and an allocation (one sbatch
    --exclude'd) need not hold the plan's names."""
    from mscale.hostlist import expand_hostlist
    from mscale.topology.placement import placement_for

    env = os.environ if env is None else env
    placement = placement_for(plan)
    used = sorted({placement.node(r) for r in range(placement.world)})
    names = [plan.cluster.node_names()[i] for i in used]
    if launcher == "slurm":
        try:
            step = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                   or env.get("SLURM_NODELIST") or "")
        except ValueError:
            step = []
        names = step if len(step) == len(used) else names
    slurm = None
    if env.get("SLURM_JOB_ID"):
        nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        slurm = {"job_id": env["SLURM_JOB_ID"], "job_name": env.get("SLURM_JOB_NAME"),
                 "nodelist": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
                 "nnodes": int(nnodes) if nnodes and nnodes.isdigit() else None}
    base = {"argv": None, "cwd": None, "plan": None, "local": 0, **(launch or {})}
    # the node's offset from UTC: slurmstepd stamps its cancel lines in the node's local time,
    # and recover, maybe on a login node elsewhere, compares them with Unix times
    return {**base, "nodes": names, "slurm": slurm,
            "utc_offset_s": time.localtime().tm_gmtoff}


def open_session(run: RunDir, env: LaunchEnv) -> RunSession:
    return RunSession(run, Journal(run, enabled=env.rank == 0), run_id_from_env())
