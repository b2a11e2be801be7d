"""Rank 0's console lines while the training thread waits for a checkpoint write.

Why: a save that is slower than the steps between saves (a loaded filesystem) holds the job at
the next save, at a halt and at the end; the checkpointer warns only every ``--timeout`` seconds
(120 by default), so an operator who pressed Ctrl-C saw nothing for minutes and could only guess
whether a second Ctrl-C (which drops the save) was needed.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

from mscale.distributed import periodic
from mscale.train.announce import say

if TYPE_CHECKING:
    from mscale.ckpt.checkpointer import Checkpointer
    from mscale.train.engine import Engine

NOTICE_EVERY_S = 10.0
"""Seconds between the lines while the wait lasts: the console's longest silence."""


@contextmanager
def said_while_waiting(say: Callable[[str], None], inflight, purpose: str,
                       every_s: float | None = None) -> Iterator[None]:
    """Run the body (a call that may wait for the save ``inflight``, a `ckpt.committer.InFlight`
    or None); each ``every_s`` (`NOTICE_EVERY_S`) it lasts, ``say`` one line naming the save and
    ``purpose`` (what waits for it: "the stop", "the save of step 6"). Nothing in flight:
    nothing is said."""
    if inflight is None:
        yield
        return
    t0 = time.monotonic()

    def notice() -> None:
        say(f"checkpoint {inflight.name} still being written after "
            f"{time.monotonic() - t0:.0f} s; {purpose} waits for it")

    with periodic.every(every_s or NOTICE_EVERY_S, notice, "ckpt-wait-notice"):
        yield


def rank0_waiting(engine: Engine, ckpt: Checkpointer, purpose: str):
    """Rank 0's lines while ``purpose`` waits for ``ckpt``'s save in flight; other ranks say
    nothing (`said_while_waiting` with nothing in flight)."""
    inflight = ckpt.inflight if engine.env.rank == 0 else None
    return said_while_waiting(lambda line: say(engine, line), inflight, purpose)
