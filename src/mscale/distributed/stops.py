"""What a ``--local`` launcher does when the operator asks its job to stop.

The first stop signal (SIGINT: Ctrl-C; SIGTERM; SIGHUP: a closed terminal, unless ignored as under
``nohup``) is passed to every worker as SIGTERM, which a training worker reads as "save a
checkpoint at the next step boundary, then stop" (train/control.py). A terminal's Ctrl-C also
reaches the workers themselves (they share its process group); training reads that SIGINT the
same way, so one Ctrl-C is one orderly stop.

A second Ctrl-C means *now*, as in most tools: the workers are killed at once. A checkpoint being
written is then never committed and the previous one stays valid (ckpt/commit.py). The stop is
said on the console once, from the launcher's watching loop: a signal handler may interrupt a
console write, so it only records.
"""

from __future__ import annotations

import signal
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


class StopRequests:
    """The stop signals a launcher received, and their effect on its workers.

    ``procs``: the launcher's list of workers, appended to as they start; a stop asked for while
    some were still starting reaches them through `resend` once all have started."""

    def __init__(self, procs: Sequence, notice: Notice = generic_notice):
        self.procs = procs
        self.notice = notice
        self.first: int | None = None
        """The first stop signal received; None while nobody asked."""
        self.forced = False
        """A second Ctrl-C killed the workers (no checkpoint)."""
        self._pending: list[str] = []

    @property
    def first_name(self) -> str | None:
        return signal.Signals(self.first).name if self.first is not None else None

    def handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.first is not None and signum == signal.SIGINT and not self.forced:
            self.forced = True
            self._pending.append("second Ctrl-C: stopping the workers now, without a "
                                 "checkpoint (the last committed one stays valid)")
        elif self.first is None:
            self.first = signum
            self._pending.append(self.notice(signal.Signals(signum).name))
        self.resend()

    def resend(self) -> None:
        """Tell every running worker what was asked: SIGTERM, or SIGKILL once forced."""
        if self.first is None:
            return
        for p in list(self.procs):
            if p.poll() is None:
                p.kill() if self.forced else p.send_signal(signal.SIGTERM)

    def take_notes(self) -> list[str]:
        """The lines to print, each once (called from the watching loop, not a handler)."""
        notes, self._pending = self._pending, []  # a note added meanwhile lands in ``notes``
        return notes
