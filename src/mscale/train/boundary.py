"""The step boundary: what every rank does, together, between two optimizer steps.

Why a module of its own: a boundary is where every rank must take the same decision at the same
step (a halt, an abort on rank 0's trouble, a save), or its peers wait in a collective until the
timeout. The loop (train/loop.py) runs steps; this decides, after each, whether it goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mscale.errors import EXIT_BAD_INPUT, EXIT_WARNING
from mscale.train.announce import event
from mscale.train.control import Control
from mscale.train.session import RunSession
from mscale.train.waiting import rank0_waiting

if TYPE_CHECKING:
    from mscale.ckpt.checkpointer import Checkpointer
    from mscale.train.engine import Engine


@dataclass
class Boundary:
    """What the loop does after a step (`at_boundary`)."""

    stop: tuple[int, tuple[str, int, str]] | None = None
    """The loop returns this (exit code, (why, step, detail)); None: it goes on."""
    saving: bool = False
    """A save started here: its host copy overlaps the next step (the record's flag)."""
    trace: bool = False
    """Record the next step's timeline (an operator's control/trace)."""


def at_boundary(engine: Engine, s: RunSession, ckpt: Checkpointer, control: Control, step: int,
                lr: float) -> Boundary:
    """Collective, after (0-based) ``step`` on every rank: the save in flight polled, rank 0's
    trouble and the operator's requests agreed, then the save that is due started. Rank 0 reads
    lock.json before any save: with the trouble check when an interval or final save is due,
    else when a request starts one (`lock_before_requested_save`)."""
    done = step + 1
    ckpt.poll()  # before the stop decision: a save failed on a full disk stops here
    interval_due = bool(ckpt.due(done, final=done == engine.plan.training.steps))
    trouble = s.trouble(save_due=engine.env.rank == 0 and interval_due) or ckpt.fatal
    decision = control.poll(abort=trouble is not None)
    if decision.abort:
        return Boundary(stop=(EXIT_BAD_INPUT, ("abort", done, trouble or "rank 0 could not go "
                                                "on (its output says why)")))
    if decision.checkpoint or decision.stop:
        event(s, kind="signal" if decision.signal else "control",
              step=done, severity="warning" if decision.stop else "info",
              message=decision.message,
              evidence={"checkpoint": decision.checkpoint, "halt": decision.halt,
                        "signal": decision.signal})
    reason = ckpt.due(done, requested=decision.checkpoint or decision.stop)
    lost = lock_before_requested_save(s, control, engine.env.rank) \
        if reason and not interval_due else None
    if lost is not None:
        return Boundary(stop=(EXIT_BAD_INPUT, ("abort", done, lost)))
    if reason:
        with rank0_waiting(engine, ckpt, f"the save of step {done}"
                           + (" before the stop" if decision.stop else "")):
            ckpt.save(done, reason, lr=lr)
    if decision.stop:
        why = "signal" if decision.signal else "halt"
        return Boundary(stop=(EXIT_WARNING, (why, done, "a checkpoint is saved before the "
                                             "stop; the same command resumes")))
    return Boundary(saving=bool(reason), trace=decision.trace)


def lock_before_requested_save(s: RunSession, control: Control, rank: int) -> str | None:
    """Collective, before a save that a request (control file, signal) started at a boundary
    where no interval or final save was due, so rank 0 has not read lock.json yet: it does now,
    as `RunSession.trouble` does before those, and every rank learns whether to stop instead.
    A job woken past its lease by a SIGTERM would otherwise truncate the shard files of a step
    the run's new owner committed. One more small all-reduce, only when a request came."""
    trouble = s.trouble(save_due=True) if rank == 0 else None
    if not control.agree(trouble is not None):
        return None
    return trouble or "rank 0 could not go on (its output says why)"
