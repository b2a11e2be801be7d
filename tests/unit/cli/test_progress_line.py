"""The throttled progress line the long commands share (cli/progress.py): once per interval,
nothing before the first interval has passed, and a line of its own (`say`) never lands on the
end of a redrawn terminal line."""

from __future__ import annotations

import io

from mscale.cli.progress import ThrottledLine


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_due_once_per_interval_counted_from_the_restart():
    now = [10.0]
    line = ThrottledLine("x", stream=io.StringIO(), tick_s=1.0, plain_every_s=5.0,
                         clock=lambda: now[0])
    now[0] = 14.0
    line.restart()  # the work proper starts now: the first interval counts from here
    seen = []
    for t in (15.0, 18.9, 19.0, 20.0, 24.0, 24.1):
        now[0] = t
        seen.append(line.due())
    assert seen == [False, False, True, False, True, False]
    assert line.elapsed() == 24.1 - 14.0


def test_say_erases_a_redrawn_line_first():
    now = [0.0]
    line = ThrottledLine("x", stream=Tty(), tick_s=1.0, clock=lambda: now[0])
    now[0] = 1.0
    assert line.due()
    line.show("x: half")
    line.say("skipped a.jsonl: not UTF-8")
    line.close()  # nothing left to erase
    assert line.stream.getvalue() == "\rx: half\x1b[K\r\x1b[Kskipped a.jsonl: not UTF-8\n"
