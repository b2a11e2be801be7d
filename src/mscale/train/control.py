"""Requests to a running job, from files and signals, agreed by all ranks at each step boundary.

Operators (and `watch`/`recover`) drop an entry in ``RUN_DIR/control/``: ``checkpoint`` (save
now), ``halt`` (save, then stop cleanly) or ``trace`` (record the next step's timeline); a file or a
directory of that name counts alike. SIGTERM, SIGUSR1 (SLURM's pre-timeout warning,
``--signal=USR1@300``, sent to the job's steps: with ``B:`` only the batch shell gets it), SIGINT
(Ctrl-C; torchrun passes its own on) and SIGHUP (a closed terminal; torchrun passes it on too)
mean halt; a second SIGINT (not a repeat of the first within `stops.REPEAT_S`) interrupts at
once, without a checkpoint, as a second Ctrl-C does in most tools. Under torchrun the agent
SIGKILLs its workers ``--shutdown-timeout`` (30 s) after passing the signal on: a save that takes
longer is lost (docs/train.md). A signal the process was started
with ignored (``nohup``, a ``--local`` worker's SIGHUP: its launcher decides) stays ignored.

Only rank 0 reads the directory (12,288 ranks polling a shared filesystem every step would be a
denial of service); any rank may receive a signal. One MAX
all-reduce of a small flag vector per step makes every rank take the same decision at the same
step, so no rank can miss it and leave its peers hanging in a collective.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mscale.distributed import early_signals
from mscale.distributed.lifeline import launcher_stop_signal
from mscale.distributed.stops import REPEAT_S
from mscale.runs.atomic import fs_and_path

REQUESTS = ("checkpoint", "halt", "trace")
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP")
                     if hasattr(signal, n))
"""The signals that ask a training job to save a checkpoint and stop."""


@dataclass
class Decision:
    """What every rank does after this step."""

    checkpoint: bool = False
    halt: bool = False
    signal: bool = False
    """A rank received a stop signal (`STOP_SIGNALS`; halt implied)."""
    abort: bool = False
    """A rank cannot go on (rank 0: the disk is full, the run directory's lock was lost): every
    rank stops here, without a checkpoint."""
    trace: bool = False
    """Record the next step's timeline (train/trace.py)."""

    @property
    def stop(self) -> bool:
        return self.halt or self.signal or self.abort

    @property
    def message(self) -> str:
        """The ``control``/``signal`` event's message for a checkpoint or stop request."""
        parts = []
        if self.checkpoint:
            parts.append("checkpoint requested: saving at this step boundary")
        if self.halt or self.signal:
            parts.append("saving a checkpoint, then halting at this step boundary"
                         + (" on a signal" if self.signal else " on a control/halt request"))
        return "; ".join(parts)


class Control:
    """Polls the control directory on rank 0 and agrees on a decision with every rank."""

    def __init__(self, control_dir: str | None, rank: int):
        self.control_dir, self.rank = control_dir, rank
        self._signalled = False
        self._interrupted_at: float | None = None  # a later SIGINT interrupts at once
        self.first_signal: int | None = None

    def install_signal_handlers(self) -> None:
        """Turn the stop signals into a flag checked at the next step boundary. Left alone: a
        signal ignored when the job started (the operator or the launcher chose that). A
        signal `mscale train` noted while it was starting (`early_signals`) counts as received
        now."""
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self._on_signal)
        for sig in early_signals.take():
            self._on_signal(sig, None)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        now = time.monotonic()
        if signum == signal.SIGINT and self._interrupted_at is not None \
                and now - self._interrupted_at > REPEAT_S:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now; the last checkpoint stays valid
        if signum == signal.SIGINT and self._interrupted_at is None:
            self._interrupted_at = now
        self._signalled = True
        self.first_signal = self.first_signal or signum

    @property
    def signal_name(self) -> str | None:
        """The first stop signal this rank received (``SIGINT``; under ``--local`` a Ctrl-C
        comes before the launcher's SIGTERM), None if it received none. A SIGTERM the
        ``--local`` launcher passed on is named as the signal the launcher got (a SIGINT or a
        SIGHUP sent to it alone): the operator's stop, not the scheduler's."""
        if not self.first_signal:
            return None
        name = signal.Signals(self.first_signal).name
        return (launcher_stop_signal() or name) if name == "SIGTERM" else name

    def waiting(self) -> list[tuple[str, float]]:
        """Rank 0, before the first step: the requests already there, with their times, left in
        place. One dropped for an earlier attempt that ended first is honoured at this one's
        first step boundary (an operator's halt must not be lost to a crash); the console says
        so before the start, so that a stale one is no surprise."""
        _, found = self._requests()
        return [(name, _seconds(info.get("mtime") or info.get("created") or 0.0))
                for name, info in found]

    def _read_requests(self) -> list[str]:
        """Names of pending request files; each is consumed (deleted) when read."""
        fs, found = self._requests()
        for _, info in found:
            self._consume(fs, info["name"])
        return [name for name, _ in found]

    def _requests(self) -> tuple[object, list[tuple[str, dict]]]:
        """Rank 0: the filesystem and the request entries of the control directory."""
        if self.rank != 0 or not self.control_dir:
            return None, []
        fs, root = fs_and_path(self.control_dir)
        if not fs.exists(root):
            return fs, []
        entries = ((info["name"].rstrip("/").rsplit("/", 1)[-1], info)
                   for info in fs.ls(root, detail=True))
        return fs, [(name, info) for name, info in entries if name in REQUESTS]

    @staticmethod
    def _consume(fs, path: str) -> None:
        """Remove a request, whatever kind of entry it is (``mkdir control/halt`` is a request
        too). One that cannot be removed is still honoured; it is simply seen again next step."""
        try:
            fs.rm(path, recursive=fs.isdir(path))
        except OSError:
            pass

    def poll(self, group=None, abort: bool = False) -> Decision:
        """Collective: every rank must call it at the same step. ``abort``: this rank cannot go
        on (Decision.abort), so every rank stops here."""
        requests = self._read_requests()
        flags = torch.tensor([float("checkpoint" in requests), float("halt" in requests),
                              float(self._signalled), float(abort), float("trace" in requests)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return Decision(checkpoint=bool(flags[0]), halt=bool(flags[1]), signal=bool(flags[2]),
                        abort=bool(flags[3]), trace=bool(flags[4]))

    def stop_signalled(self) -> bool:
        """Collective: True on every rank when any rank has received a stop signal. Asked
        between held-out eval batches (train/evaluate.py), so a Ctrl-C need not wait for the
        whole evaluation; the signal stays pending for the step boundary's `poll`, which saves
        and stops. Control files wait for the boundary: only rank 0 may read the directory."""
        return self.agree(self._signalled)

    @staticmethod
    def agree(flag: bool, group=None) -> bool:
        """Collective: True on every rank when ``flag`` is True on any."""
        flags = torch.tensor([float(flag)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return bool(flags[0])


def _seconds(when) -> float:
    """An fsspec ``mtime``/``created`` as seconds since the epoch (a number or a datetime)."""
    return float(when.timestamp() if hasattr(when, "timestamp") else when)
