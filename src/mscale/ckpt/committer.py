"""Rank 0's half of a save, after every rank has written its shard: the gathered reports become
a manifest and a commit, and each save's end (committed, failed, refused) becomes an event and,
where the job must stop, `Committer.fatal`.

It runs on rank 0's writer thread (`assemble`, `commit`) and on its training thread
(`failed_on`, when a save failed on some ranks, judged at the step boundary). `Checkpointer` (checkpointer.py)
owns one and decides when each save starts and ends; this module decides what the end means.
No collective runs here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

from mscale.ckpt import catalog, commit
from mscale.ckpt.manifest import TrainState
from mscale.runs.atomic import is_disk_full

Emit = Callable[..., None]
"""``emit(kind=, severity=, step=, message=, evidence=)``: appends an event (rank 0 only)."""


@dataclass
class InFlight:
    """A save started and not yet committed or failed (at most one per job)."""

    step: int
    name: str
    """Its directory under the run's checkpoint folder (``step-000040``)."""
    reason: str
    """Why it was made: interval, request, final, halt."""
    future: object
    """The writer thread's job: (`writer.WriteResult`, copy seconds), or the write's error."""
    gate: object
    """The `snapshot.CopyGate` the next optimizer update waits on."""
    call_s: float
    """Seconds the save call itself took (waiting for a previous save included)."""
    waited_s: float
    """Of those, seconds spent waiting for the previous save to be written and committed."""
    state: TrainState
    started: float = field(default_factory=time.perf_counter)


class Committer:
    """Rank 0's record of how each save ended; see the module docstring."""

    def __init__(self, root: str, keep: int, emit: Emit,
                 lock_lost: Callable[[], str | None] = lambda: None):
        """``root``: the run's checkpoint folder; ``keep``: how many checkpoints retention
        keeps; ``lock_lost()``: why this job no longer holds its run directory, None while it
        does (asked right before each commit)."""
        self.root, self.keep, self.emit, self.lock_lost = root, keep, emit, lock_lost
        self.fatal: str | None = None
        """Why the job must stop (a save failed on a full disk, a commit was refused); None
        while it may go on. Set on the training or the writer thread, read by the loop at a
        step boundary."""
        self.refused: str | None = None
        """Why a commit was refused (the run's lock is another job's now); then no resume from
        here is this job's to make (`unsaved_end`)."""
        self.failed: dict[int, str] = {}
        """The steps whose save failed, each with the failure's message; read after the
        checkpointer's close to tell whether the save that ended the run was kept."""

    def assemble(self, fl: InFlight, raw: list[bytes], build: Callable[[list[dict]], object]):
        """Writer thread: the gathered reports (none failed: the training thread judged those)
        → ``build(reports)``, the manifest → commit. An error here is a failed commit (an
        event, the attempt removed), never an exception left unread in the writer's future."""
        try:
            reports = commit.decode_gathered(raw)
            del raw
            manifest = build(reports)
            evidence = _evidence(fl, reports)
        except Exception as e:  # noqa: BLE001 - reported as `commit` reports its own errors
            self._not_committed(fl, e, {"reason": fl.reason})
            return
        del reports
        self.commit(fl, manifest, evidence)

    def commit(self, fl: InFlight, manifest, evidence: dict) -> None:
        """Lock check → manifest → marker → ``latest`` → retention (commit.py), and its event."""
        try:
            result = commit.commit(self.root, fl.name, manifest, self.keep, self.lock_lost)
        except commit.CommitRefused as e:
            self._refused(fl, str(e), evidence)
            return
        except Exception as e:  # noqa: BLE001 - a failed commit is an event, not a crash
            latest = self.latest()
            if latest == fl.name:  # the pointer moved before the error: the checkpoint stands
                self._committed(fl, evidence, {"commit_error": f"{type(e).__name__}: {e}"})
                return
            self._not_committed(fl, e, evidence, latest)
            return
        self._committed(fl, evidence, result)

    def failed_on(self, fl: InFlight, failed: list[dict]) -> str:
        """Training thread: record a save that failed on some ranks (their reports, each with
        its ``error``); returns its directory, for the caller to remove."""
        path = catalog.join(self.root, fl.name)
        latest = self.latest()
        then = self._then(fl, latest, any(r.get("disk_full") for r in failed))
        self.failed[fl.step] = (f"checkpoint {fl.name} failed on {len(failed)} rank(s): "
                                f"{failed[0]['error']}")
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  ranks=[r["rank"] for r in failed],
                  message=f"{self.failed[fl.step]}; {then}",
                  evidence={"path": path, "reason": fl.reason, "latest": latest,
                            "errors": {str(r["rank"]): r["error"] for r in failed[:16]},
                            "action": "attempt removed"})
        return path

    def unsaved_end(self, step: int) -> str | None:
        """Why the save of ``step`` (the run's last) was not kept, or None when it was kept or
        never made. The steps since ``latest`` are then lost with the process, which the job's
        exit code must say (docs/train.md, "Exit codes"). A refused commit says why whatever the
        step: the run is another job's now."""
        if self.refused is not None:
            return self.refused
        if step not in self.failed:
            return None
        return (f"{self.failed[step]}; latest stays {self.latest() or '(none yet)'}: the steps "
                "after it are not saved; fix the checkpoint storage, then the same command "
                "resumes from it")

    def latest(self) -> str | None:
        """What ``latest`` names, for a failure event (which must not fail in turn)."""
        try:
            return catalog.read_latest(self.root)
        except Exception as e:  # noqa: BLE001 - an unreadable pointer is part of the report
            return f"(unreadable: {e})"

    def _not_committed(self, fl: InFlight, e: Exception, evidence: dict,
                       latest: str | None = None) -> None:
        """A save written on every rank that failed before ``latest`` named it: the attempt is
        removed, `failed` and a critical event say why (a full disk also sets `fatal`)."""
        latest = latest if latest is not None else self.latest()
        with contextlib.suppress(Exception):  # a dead attempt; the next start removes it too
            catalog.remove(catalog.join(self.root, fl.name))
        then = self._then(fl, latest, is_disk_full(e))
        self.failed[fl.step] = f"checkpoint {fl.name} written but not committed: {e}"
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  message=f"{self.failed[fl.step]}; {then}",
                  evidence={**evidence, "error": f"{type(e).__name__}: {e}",
                            "latest": latest, "action": "attempt removed"})

    def _refused(self, fl: InFlight, why: str, evidence: dict) -> None:
        """The run's lock is another job's now (checkpointer.py's docstring): the attempt stays
        as it is, and `fatal` stops the job, since every later commit would be refused too."""
        self.refused = self.fatal = f"{why}: checkpoint step {fl.step} not committed"
        self.emit(kind="checkpoint_failed", severity="critical", step=fl.step,
                  message=f"{self.refused}; this job stops (exit 3)",
                  evidence={**evidence, "error": why, "latest": self.latest(),
                            "action": "attempt left uncommitted to the run's owner"})

    def _committed(self, fl: InFlight, evidence: dict, result: dict) -> None:
        self.emit(kind="checkpoint", severity="info", step=fl.step,
                  message=f"checkpoint {fl.name} committed ({fl.reason})",
                  evidence={**evidence, **result, "total_s": time.perf_counter() - fl.started})
        trouble = (result.get("retention_error") or result.get("commit_error")
                   or result.get("lock_check_error"))
        if trouble:  # the checkpoint is good; what failed around it is said, not hidden
            what = ("deleting older checkpoints (retention) failed; they are kept until the "
                    "next commit" if "retention_error" in result else
                    "an error came after latest was moved to it" if "commit_error" in result
                    else "the run's lock.json could not be read before it (committed: the "
                    "lock's heartbeat still watches for a takeover)")
            self.emit(kind="info", severity="warning", step=fl.step,
                      message=f"checkpoint {fl.name} committed, but {what}: {trouble}",
                      evidence={"path": catalog.join(self.root, fl.name), **result})

    def _then(self, fl: InFlight, latest: str | None, full: bool) -> str:
        """What happens after a failed save; a full disk sets `fatal`."""
        keep = f"latest stays {latest or '(none yet)'}"
        if not full:
            return f"training continues, {keep}"
        self.fatal = (f"checkpoint {fl.name} failed: the disk is full; {keep}; free space on "
                      f"{self.root}, then resume")
        return f"the job stops at the next step boundary (a full disk), {keep}"


def _evidence(fl: InFlight, reports: list[dict]) -> dict:
    stored = sum(r["shard"]["bytes"] for r in reports)
    raw = sum(r.get("raw_bytes", 0) for r in reports)
    write_s = max(r.get("write_s", 0.0) for r in reports)
    return {"reason": fl.reason, "blocking_s_max": max(r["blocking_s"] for r in reports),
            "update_waited_s_max": max(r["gate_waited_s"] for r in reports),
            "copy_s_max": max(r.get("copy_s", 0.0) for r in reports),
            "waited_for_previous_s_max": max(r["waited_s"] for r in reports),
            "write_s_max": write_s, "stored_bytes": stored, "raw_bytes": raw,
            "shards": len(reports), "write_gb_per_s": stored / write_s / 1e9 if write_s else None}
