"""Stop signals read as Ctrl-C while a command works, so that it ends the way Ctrl-C ends it.

A command that cleans up or reports on ``KeyboardInterrupt`` (``data prepare`` removes its
temporary folder; ``watch`` prints its last line, writes its report and exits with the verdict of
what it judged) would otherwise die of SIGTERM (scancel, a CI timeout, systemd, Kubernetes) with
none of that done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def stop_signals_as_interrupt(*signals: int) -> Iterator[None]:
    """Raise ``KeyboardInterrupt`` on each of ``signals`` inside the block; the previous handlers
    come back after it. A signal ignored when the block starts (``nohup`` for SIGHUP) stays
    ignored; off the main thread, where handlers cannot be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):  # noqa: ARG001 - a signal handler's signature
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupt) for s in signals
           if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
