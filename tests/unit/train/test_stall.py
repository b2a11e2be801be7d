"""train/stall.py: the line said while a step outlasts the steps before it."""

from __future__ import annotations

from mscale.train.stall import FIRST_STEP_S, STALL_MIN_S, StallNotice


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def notice(timeout_s=120.0):
    clock = Clock()
    n = StallNotice(lambda line: None, timeout_s, clock=clock)
    n.since = clock.now  # what begin() sets, without its thread
    return n, clock


def test_a_step_far_past_its_peers_is_said_once_per_threshold():
    n, clock = notice()
    for step in range(1, 6):  # steps of 0.3 s
        clock.now += 0.3
        n.finished(step)
    clock.now += STALL_MIN_S - 1
    assert n.check() is None  # slow, not yet stalled
    clock.now += 2
    line = n.check()
    assert line == ("no step has finished for 31 s since step 5 (steps took 0.3 s): if a rank "
                    "is hung, the others wait for it up to --timeout 120 s, then the job stops "
                    "and names it")
    assert n.check() is None  # said once ...
    clock.now += STALL_MIN_S
    assert "for 61 s since step 5" in n.check()  # ... and again a threshold later
    clock.now += 1
    n.finished(6)  # the stalled step is not a norm: the median stays 0.3 s
    assert n.threshold() == STALL_MIN_S and n.check() is None


def test_slow_steps_raise_the_bar_and_the_first_step_has_its_own():
    n, clock = notice()
    clock.now += FIRST_STEP_S - 1
    assert n.check() is None  # the first step warms up (and compiles)
    clock.now += 2
    assert "since the attempt's start (the first step warms up" in n.check()
    n, clock = notice()
    for step in range(1, 4):  # steps of 8 s: ten of them is the bar
        clock.now += 8
        n.finished(step)
    clock.now += 79
    assert n.check() is None
    clock.now += 2
    assert "for 81 s since step 3 (steps took 8 s)" in n.check()
