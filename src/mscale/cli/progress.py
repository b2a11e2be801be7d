"""The progress line every long offline command shows (`data prepare`, `ckpt convert`, ...).

It goes to stderr, so that stdout stays the command's result (one JSON document with --json),
and it is throttled twice over: on a terminal one line redrawn in place (and erased at the end)
at most every ``tick_s``; elsewhere (CI, a pipe, a SLURM log) a plain line at most every
``plain_every_s``, so that a log shows the job moving without a line per tensor. The first line
comes one interval after the start, so work that ends sooner shows its start line and its
closing line only. Intervals and clock are injectable, so that tests never sleep. Thread-safe:
a job's worker thread may `say` (a skipped record) while the main thread shows progress.
"""

from __future__ import annotations

import sys
import threading
import time


class ThrottledLine:
    """A job's start line (`say`), its throttled progress (`due` then `show`), and `close`."""

    def __init__(self, label: str, stream=None, tick_s: float = 0.5, plain_every_s: float = 2.0,
                 clock=time.monotonic) -> None:
        self.label, self.stream = label, stream or sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.every = tick_s if self.tty else plain_every_s
        self.clock = clock
        self.started = self.last = clock()
        self._shown = False
        self._lock = threading.RLock()  # `say` closes, under the same lock

    def restart(self) -> None:
        """Count time (rate, the first interval) from now: the work proper begins."""
        self.started = self.last = self.clock()

    def elapsed(self) -> float:
        return max(self.clock() - self.started, 1e-9)

    def due(self) -> bool:
        """True, once per interval, when a progress line may be shown now."""
        with self._lock:
            now = self.clock()
            if now - self.last < self.every:
                return False
            self.last = now
            return True

    def show(self, line: str) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r" + line + "\x1b[K")
                self._shown = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Erase a redrawn line, so that what follows (the closing line, an error) stands
        alone."""
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False

    def say(self, text: str) -> None:
        """A line of its own (the start line, a skipped record), above any progress line."""
        with self._lock:
            self.close()
            self.stream.write(text + "\n")
            self.stream.flush()
