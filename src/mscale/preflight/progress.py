"""Rank 0's progress lines on stderr while a long phase runs (stdout keeps the report).

A preflight with a degraded link used to sit silent for minutes inside one phase. Rank 0 now
says which phase it entered (`runner._phase`, always) and, while the link tests run, how far
they are and the slowest link so far (`LinkProgress`), at most one line every `EVERY_S`
seconds, so a healthy run prints what it printed before and a slow one is never silent for
long. Other ranks print nothing: their `LinkProgress` is built with ``ticker=None``.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

EVERY_S = 5.0
"""At most one progress line this often (phase lines are always printed, and reset it)."""


class Ticker:
    """Writes rank 0's lines, each with the seconds since the job started; throttled ones only
    when `every_s` passed since the last line of any kind."""

    def __init__(self, every_s: float = EVERY_S, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.out, self.clock = every_s, out, clock
        self.started = self.last = clock()

    def line(self, text: str, force: bool = True) -> bool:
        now = self.clock()
        if not force and now - self.last < self.every_s:
            return False
        self.last = now
        print(f"{text} (at {now - self.started:.1f} s)", file=self.out or sys.stderr, flush=True)
        return True


TICKER = Ticker()
"""This process's ticker (used on rank 0 only)."""


class LinkProgress:
    """How far one phase's link tests are, for rank 0: the pass and the items done in it, the
    slowest figure so far and how many were cut short (`pace.py`).

    Every link is measured in `passes` passes (pace.PASSES), so ``total`` counts each item
    once per pass; the line says ``pass 1/2, 6/12 pairs``, not ``6/24 pairs``, which read as 24
    pairs where the plan has 12 (and ``6/6 groups`` under a re-check of 3 groups)."""

    def __init__(self, label: str, noun: str, total: int, ticker: Ticker | None,
                 passes: int = 1) -> None:
        self.label, self.noun, self.total, self.ticker = label, noun, total, ticker
        self.passes = passes
        self.done = 0
        self.cut = 0
        self.slowest: tuple[float, str] | None = None
        self.started = ticker.clock() if ticker else 0.0

    def add(self, figures: list[tuple[str, float, str, bool]], items: int | None = None) -> None:
        """Items just finished, ``items`` of them (default: one per figure), each figure
        (what, value, unit, cut short); maybe a line."""
        self.done += len(figures) if items is None else items
        if not figures:
            return
        for what, value, unit, cut in figures:
            self.cut += int(cut)
            if value == value and (self.slowest is None or value < self.slowest[0]):
                self.slowest = (value, f"{what} {value:.4g} {unit}")
        if self.ticker is not None and self.done < self.total:  # the last: `finish` says it
            self.ticker.line(self.text(), force=False)

    def text(self) -> str:
        out = f"preflight {self.label}: {self._how_far()} {self.noun}"
        if self.slowest is not None:
            out += f", slowest so far {self.slowest[1]}"
        if self.cut:
            out += f", {self.cut} test(s) cut short (far below their peers)"
        return out

    def _how_far(self) -> str:
        """``6/12`` of the items, after ``pass 1/2, `` when there are several passes."""
        per = self.total // self.passes if self.passes > 1 else 0
        if not per:
            return f"{self.done}/{self.total}"
        now = max(1, min(-(-self.done // per), self.passes))  # a pass just ended: its own
        return f"pass {now}/{self.passes}, {self.done - (now - 1) * per}/{per}"

    def finish(self) -> None:
        """A last line, only for a phase long enough to have needed progress lines."""
        if self.ticker is not None and self.ticker.clock() - self.started >= self.ticker.every_s:
            self.ticker.line(self.text() + " - done")
