"""What a ``--local`` launcher does when the operator asks its job to stop.

The first stop signal (SIGINT: Ctrl-C; SIGTERM; SIGHUP: a closed terminal, unless ignored as under
``nohup``) is passed to every worker as SIGTERM, which a training worker reads as "save a
checkpoint at the next step boundary, then stop" (train/control.py); the workers are told its
name first (``tell``, over the lifeline), so that what they record names the operator's
signal. A terminal's Ctrl-C also reaches the workers themselves (they share its process
group); training reads that SIGINT the same way, so one Ctrl-C is one orderly stop.

A second Ctrl-C (more than `REPEAT_S` after the first) means *now*, as in most tools: the
workers are killed at once. A checkpoint being
written is then never committed and the previous one stays valid (ckpt/commit.py). The stop is
said on the console once, from the launcher's watching loop: a signal handler may interrupt a
console write, so it only records.
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Sequence

Notice = Callable[[str], str]
"""The console line for the first stop signal, given its name (``SIGINT``)."""


def generic_notice(name: str) -> str:
    return (f"stop requested ({name}): the workers were asked to stop; Ctrl-C again to stop "
            "them now")


def forwarded_signals() -> tuple[int, ...]:
    """The signals a launcher passes on to its workers as SIGTERM ("checkpoint, then stop"):
    SIGINT, SIGTERM, and SIGHUP unless it is ignored (``nohup``: the operator asked the job to
    survive the hangup)."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    return tuple(sigs)


REPEAT_S = 1.0
"""A SIGINT this soon after the first stop signal is the same request, not a second Ctrl-C:
wrappers pass a terminal's SIGINT on to a group that got it already (GNU ``timeout`` does), so
one press can arrive two or three times within milliseconds."""


STOPPED_CODES = (130, -signal.SIGINT, -signal.SIGTERM) + (
    (-signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
"""How a worker ends when a stop signal ends it before it could stop in order: 130 (a
KeyboardInterrupt, `forkserver` and train's edge both exit so), or killed by the signal itself
(start-up, before a handler was installed)."""


def ended_by_stop(code: int | None, forced: bool) -> bool:
    """Whether a worker's exit ``code`` is what the operator's stop does to a worker (or a
    normal end: 0, 1 halted, 2 NaN); SIGKILL only when a second Ctrl-C forced it."""
    if code is None or code in (0, 1, 2) or code in STOPPED_CODES:
        return True
    return forced and code == -signal.SIGKILL


class StopRequests:
    """The stop signals a launcher received, and their effect on its workers.

    The handler only records (it may run in the middle of the watching loop's own poll of a
    worker); `deliver`, called from that loop and once every worker has started, signals them.
    ``procs``: the launcher's list of workers, appended to as they start."""

    def __init__(self, procs: Sequence, notice: Notice = generic_notice,
                 clock: Callable[[], float] = time.monotonic,
                 tell: Callable[[str], None] | None = None):
        self.procs = procs
        self.notice = notice
        self.tell = tell
        """Tells the workers the first signal's name before they get SIGTERM for it
        (`Lifeline.tell_stop`): the operator's SIGINT or SIGHUP is not the scheduler's SIGTERM."""
        self.clock = clock
        self.first: int | None = None
        """The first stop signal received; None while nobody asked."""
        self.first_at: float | None = None
        """When it came (``clock``)."""
        self.forced = False
        """A second Ctrl-C: the workers are killed (no checkpoint)."""
        self._delivered: str | None = None
        self._pending: list[str] = []

    @property
    def first_name(self) -> str | None:
        return signal.Signals(self.first).name if self.first is not None else None

    def handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        now = self.clock()
        if self.first is None:
            self.first, self.first_at = signum, now
            self._pending.append(self.notice(signal.Signals(signum).name))
        elif signum == signal.SIGINT and not self.forced and now - self.first_at > REPEAT_S:
            self.forced = True
            self._pending.append("second Ctrl-C: stopping the workers now, without a "
                                 "checkpoint (the last committed one stays valid)")

    def deliver(self) -> None:
        """Tell every running worker what was asked, once: SIGTERM, then SIGKILL if forced."""
        want = "kill" if self.forced else "term" if self.first is not None else None
        if want is None or want == self._delivered:
            return
        self._delivered = want
        if want == "term" and self.tell is not None:
            self.tell(self.first_name)
        for p in list(self.procs):
            if p.poll() is None:
                p.kill() if want == "kill" else p.send_signal(signal.SIGTERM)

    def take_notes(self) -> list[str]:
        """The lines to print, each once (called from the watching loop, not a handler)."""
        notes, self._pending = self._pending, []  # a note added meanwhile lands in ``notes``
        return notes
