"""Call a function from a thread of its own, every so often, while a body runs.

Why: a console line has to come while the calling thread is busy or blocked: the launcher
starting its workers (distributed/startup.py), a step waiting for a checkpoint write
(train/waiting.py), every rank waiting in a collective for a hung peer (train/stall.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def every(seconds: float, tick: Callable[[], bool | None], name: str) -> Iterator[None]:
    """Call ``tick`` every ``seconds`` from a daemon thread named ``name`` while the body runs;
    a tick that returns True ends the calls (its output is gone). The thread is joined when the
    body ends, so no tick runs after it."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(seconds):
            if tick():
                return

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
