"""A stop signal that reaches a training process before its loop listens for one.

SLURM's time-limit warning (`sbatch --signal=USR1@N`) is sent once, N seconds before the
limit, and can come while the tasks still import torch, build the model or load a checkpoint:
minutes at scale. SIGUSR1's default action kills the process with nothing recorded (exit 138),
so the batch script that requeues on train's SIGUSR1 stop never sees one and the job ends with
time left. `mscale train` (run by srun or torchrun, not the `--local` launcher, which has its
own) remembers it from its first line (`remember`); the loop's `Control` takes it over
(`take`) and saves and stops at the first step boundary, as for a signal received later.

Imports nothing but the standard library: it runs before anything heavy is loaded.
"""

from __future__ import annotations

import signal

EARLY = ("SIGUSR1",)
"""The signals remembered: the ones whose default would kill a starting job that was asked to
save and stop. SIGTERM keeps its default: a job told to end before it trained has nothing to
save, and SLURM's SIGKILL follows within KillWait whatever it does."""

_pending: list[int] = []


def _note(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    _pending.append(signum)


def remember() -> None:
    """From now on, note the EARLY signals instead of dying of them (those still at their
    default: one the operator ignored stays ignored)."""
    for name in EARLY:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _note)


def take() -> list[int]:
    """The signals noted so far, oldest first, and forget them."""
    out = list(_pending)
    _pending.clear()
    return out
