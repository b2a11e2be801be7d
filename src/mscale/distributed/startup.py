"""Start-up progress of ``--local`` workers: what each reached, shown while it lasts.

Imports alone are seconds of CPU per worker, so a start of N workers on a loaded machine is a
silent minute unless someone shows it. Each worker appends a phase marker to
``logs/rank<N>.startup`` as it reaches a phase (`mark_phase`; a no-op outside ``--local``), and the
launcher (distributed/launch.py) reads those files between polls and renders how many of the N
workers reached each phase (`StartupView`): one updating line on a terminal, a plain line when
nothing else was said for a few seconds otherwise. Markers are appended by the worker's own
thread at points it passes once; no collective, nothing per step.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TextIO

from mscale.distributed import periodic

PHASE_FILE_ENV = "MSCALE_PHASE_FILE"
"""Where a ``--local`` worker appends its start-up phase markers (set by the launcher)."""


def phase_file(log_dir: str, rank: int) -> str:
    """The start-up marker file of ``rank`` (next to its log)."""
    return os.path.join(log_dir, f"rank{rank}.startup")

def mark_phase(phase: str, env: dict[str, str] | None = None) -> None:
    """This worker reached ``phase`` of its start-up: one line appended to its marker file.

    A no-op unless the ``--local`` launcher named a file (torchrun and srun have no one to show it
    to). Never raises: start-up progress must not be a reason for a start to fail."""
    path = (os.environ if env is None else env).get(PHASE_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{phase} {time.time():.3f}\n")
    except OSError:
        pass


def read_phases(path: str) -> list[tuple[str, float]]:
    """The (phase, wall time) markers in a marker file, oldest first; a line still being written
    (no newline yet) and unreadable lines are left out; a missing file has none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(64 * 1024)
    except OSError:
        return []
    out = []
    for line in text.split("\n")[:-1]:  # the part after the last newline is not complete
        name, _, when = line.strip().partition(" ")
        try:
            out.append((name, float(when)))
        except ValueError:
            continue
    return out


def reached(markers: list[tuple[str, float]], phases: Sequence[str]) -> int:
    """How many of ``phases`` (in order) a worker has passed: the furthest one it marked, + 1."""
    names = {name for name, _ in markers}
    return max((i + 1 for i, p in enumerate(phases) if p in names), default=0)


def progress_text(counts: Sequence[int], labels: Sequence[str], nprocs: int,
                  elapsed_s: float) -> str:
    """``starting 4 workers (12 s): imported 4/4, rendezvous 2/4, model built 0/4``.

    ``counts[i]``: how many workers reached phase ``i`` (or a later one)."""
    parts = ", ".join(f"{label} {n}/{nprocs}" for label, n in zip(labels, counts))
    return f"starting {nprocs} worker{'s' if nprocs != 1 else ''} ({elapsed_s:.0f} s): {parts}"


class StartupView:
    """The workers' start-up on the console while it lasts, and the lines rank 0 writes.

    On a terminal one line is redrawn in place (``\\r``) every ``tick_s``; a line of rank 0's
    output clears it first and it is redrawn after. Elsewhere (CI, a pipe, a file) a plain line
    is written only when nothing else was written for ``plain_every_s``, so a log shows that the
    start is progressing without a line per tick. It ends (the terminal line erased) once every
    worker reached the last phase, or on `close` (a worker ended, the job is over).

    ``read`` returns each worker's markers (`read_phases`); ``clock`` and the intervals are
    injectable so that tests drive it without waiting.
    """

    def __init__(self, nprocs: int, phases: Sequence[tuple[str, str]], stream: TextIO,
                 read: Callable[[int], list[tuple[str, float]]], *, tty: bool | None = None,
                 tick_s: float = 0.5, plain_every_s: float = 4.0,
                 clock: Callable[[], float] = time.monotonic, width: int | None = None):
        self.nprocs, self.stream, self.read = nprocs, stream, read
        self.markers = [m for m, _ in phases]
        self.labels = [label for _, label in phases]
        if tty is None:
            try:
                tty = stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty, self.tick_s, self.plain_every_s, self.clock = tty, tick_s, plain_every_s, clock
        self.width = width if width is not None else _columns(stream) if tty else 0
        """A terminal line longer than the terminal wraps, and ``\r`` cannot redraw it."""
        self.started = self.last_line = clock()
        self.next_tick = self.started  # the first poll reads and draws
        self.counts = [0] * len(self.markers)
        self.done = not self.markers or nprocs <= 0
        self._shown = ""  # the text on the terminal's status line, "" when none
        self._lock = threading.Lock()

    def poll(self) -> None:
        """Read the markers and redraw, at most every ``tick_s`` (the watcher calls it often)."""
        now = self.clock()
        if self.done or now < self.next_tick:
            return
        self.next_tick = now + self.tick_s
        per_rank = [reached(self.read(r), self.markers) for r in range(self.nprocs)]
        self.counts = [sum(1 for n in per_rank if n > i) for i in range(len(self.markers))]
        with self._lock:
            if self.counts[-1] == self.nprocs:
                self._finish()
                return
            text = progress_text(self.counts, self.labels, self.nprocs, now - self.started)
            if self.tty:
                if self.width and len(text) >= self.width:
                    text = text[: max(self.width - 4, 0)] + "..."
                if text != self._shown:
                    self.stream.write("\r" + text + "\x1b[K")
                    self.stream.flush()
                    self._shown = text
            elif now - self.last_line >= self.plain_every_s:
                self._write(text + "\n", now)

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Poll from a thread of its own while the body runs: the launcher's thread is busy
        starting the workers then (the first start loads torch into the fork server: 5 s here,
        24 s on a loaded machine, more from a shared filesystem), and the console stayed silent
        after the launcher's first line until every worker had been started."""
        def tick() -> bool:
            try:
                self.poll()
            except (OSError, ValueError):  # the console is gone: the start goes on
                return True
            return False

        with periodic.every(self.tick_s, tick, "startup-view"):
            yield

    def line(self, text: str) -> None:
        """A line of rank 0's output (with its newline), written above the status line."""
        with self._lock:
            self._erase()
            self._write(text, self.clock())

    def close(self) -> None:
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        self.done = True
        self._erase()

    def _erase(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = ""

    def _write(self, text: str, now: float) -> None:
        self.stream.write(text)
        self.stream.flush()
        self.last_line = now


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 80
