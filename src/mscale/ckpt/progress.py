"""How far an offline checkpoint job (convert, verify) has got, told to a caller, never printed.

A conversion or a verify of a large checkpoint runs for minutes to hours, and its operator needs
to see that it is moving; but library code does not own a console (it runs in tests, notebooks,
recover's diagnosis). So, as `mscale.data.prepare` does, the work takes two optional callables:
``on_start(info)`` once the work is known and before its first byte (what, how many tensors and
bytes), and ``progress(done, total)`` as bytes are done. What reaches the console, where and how
often is the CLI's choice (cli/ckpt.py). No torch here: `ckpt verify` runs without it.
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes in all): ``done`` never decreases and ends at ``total``."""
OnStart = Callable[[dict], None]
"""Called once with a JSON-able description of the work, before any of it is done."""


class Tally:
    """Bytes done of a total known in advance, passed on to ``progress`` (if any) as they grow."""

    def __init__(self, total: int, progress: Progress | None = None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def add(self, n: int) -> None:
        self.to(self.done + n)

    def to(self, mark: int) -> None:
        """Move to ``mark``, never back nor past the total: a shard that could not be read
        still counts as done, so that the count ends at the total on every path."""
        self.done = max(self.done, min(mark, self.total))
        if self.progress is not None:
            self.progress(self.done, self.total)


def announce(on_start: OnStart | None, **known) -> OnStart | None:
    """``on_start`` with what the caller knows (source, destination, format) added to what the
    work reports (tensors, bytes), so the work itself need not be told the caller's names."""
    if on_start is None:
        return None
    return lambda info: on_start({**known, **info})
