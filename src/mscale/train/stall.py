"""Rank 0's line while a step takes far longer than the steps before it.

Why: a rank that hangs (a stopped process, a dead link) holds every other rank in its next
collective until the process group's timeout (``--timeout``, 120 s by default) runs out; only
then does the job fail and name the rank. Until then the console showed nothing, and an
operator could not tell a hung job from a slow one. Rank 0 is itself one of the waiting ranks,
so the line comes from a thread (a collective's wait releases the GIL); a rank 0 that is itself
stopped says nothing, and the timeout's failure line names it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

from mscale.distributed import periodic

STALL_MIN_S = 30.0
"""The shortest silence worth a line: a step of a big model takes seconds, a save or a held-out
evaluation between steps some more."""
STALL_FACTOR = 10.0
"""A step this many times the recent median is no noise."""
FIRST_STEP_S = 60.0
"""The first step of an attempt warms up, and compiled builds its kernels: a longer allowance,
and no median yet."""
RECENT = 16
"""Steps whose median is "the steps before it"."""


class StallNotice:
    """``begin()`` before the loop, ``finished(step)`` after each step's record; in between,
    `tick` (called from a thread: `noticing`) says one line when the current step outlasts
    `threshold` and again each time that much more has passed."""

    def __init__(self, say: Callable[[str], None], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 1.0):
        self.say, self.timeout_s, self.clock, self.poll_s = say, timeout_s, clock, poll_s
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.last_step: int | None = None
        """The newest finished step (1-based); None before the attempt's first."""
        self.since: float | None = None
        self._noted_at: float | None = None
        self._lock = threading.Lock()

    def threshold(self) -> float:
        if not self.recent:
            return FIRST_STEP_S
        return max(STALL_MIN_S, STALL_FACTOR * statistics.median(self.recent))

    def begin(self) -> None:
        self.since = self.clock()

    def finished(self, step: int) -> None:
        now = self.clock()
        with self._lock:
            if self.since is not None and self._noted_at is None:  # a stalled step is no norm
                self.recent.append(now - self.since)
            self.last_step, self.since, self._noted_at = step, now, None

    def check(self) -> str | None:
        """The line to say now, if any (`tick`'s, callable alone for tests)."""
        now = self.clock()
        with self._lock:
            if self.since is None:
                return None
            quiet, limit = now - self.since, self.threshold()
            due = (self._noted_at or self.since) + limit
            if quiet < limit or now < due:
                return None
            self._noted_at = now
            after = f"step {self.last_step}" if self.last_step else "the attempt's start"
            typical = (f"steps took {statistics.median(self.recent):.2g} s" if self.recent
                       else "the first step warms up, and compiled builds its kernels")
        return (f"no step has finished for {quiet:.0f} s since {after} ({typical}): if a rank "
                f"is hung, the others wait for it up to --timeout {self.timeout_s:g} s, then "
                "the job stops and names it")

    def tick(self) -> None:
        line = self.check()
        if line:
            self.say(line)


class _Silent:
    """What ranks other than 0 hold: the same calls, no thread."""

    def finished(self, step: int) -> None:
        pass


@contextmanager
def noticing(say: Callable[[str], None], timeout_s: float, enabled: bool
             ) -> Iterator[StallNotice | _Silent]:
    """A `StallNotice` running for the body (rank 0), else one that says nothing."""
    if not enabled:
        yield _Silent()
        return
    notice = StallNotice(say, timeout_s)
    notice.begin()
    with periodic.every(notice.poll_s, notice.tick, "stall-notice"):
        yield notice
