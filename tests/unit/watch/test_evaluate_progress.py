"""`python -m mscale.watch.detect.evaluate` says where it is while it runs, and its speed-ups change
no result: the watcher fed in chunks finds what one feed finds, and the detectors' median is
numpy's bit for bit. No waiting: the progress thread's wait and clock are injected."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mscale.watch.detect import evaluate
from mscale.watch.detect.evaluate import Job, Progress, _feed, run_case
from mscale.watch.detect.rows import median
from mscale.watch.judge import Watcher
from mscale.watch.sim import Injection, generate


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_the_line_names_the_last_place_reported_and_the_elapsed_time():
    clock = Clock()
    p = Progress(3.5, io.StringIO(), clock)
    assert p.line() == "evaluate: starting (0 s)"
    p("64 ranks, slow_link, trial 2/20, step 150/400")
    clock.t += 12.4
    assert p.line() == "evaluate: 64 ranks, slow_link, trial 2/20, step 150/400 (12 s)"


def test_the_thread_prints_a_line_per_interval_until_stopped():
    out, clock, waits = io.StringIO(), Clock(), []
    p = Progress(2.0, out, clock)

    def wait(seconds: float) -> bool:  # the stop event's wait: True once stopped
        waits.append(seconds)
        clock.t += seconds
        p(f"step {len(waits)}")
        return len(waits) > 3

    p.run(wait)
    assert waits == [2.0] * 4
    assert out.getvalue().splitlines() == ["evaluate: step 1 (2 s)", "evaluate: step 2 (4 s)",
                                           "evaluate: step 3 (6 s)"]


def test_no_thread_without_an_interval_and_the_context_stops_one():
    with Progress(0, io.StringIO()) as p:
        assert p._thread is None
    with Progress(3600, io.StringIO()) as p:
        assert p._thread is not None and p._thread.is_alive()
    assert not p._thread.is_alive()  # stopped at once, not after the interval


def test_feeding_in_chunks_finds_exactly_what_one_feed_finds():
    t = generate(64, 2, 4, None, 8, 230, 3, inject=[Injection("slow_device", 80, 5),
                                                    Injection("grad_spike", 150, None)])
    whole = Watcher(t.layout).feed(t.window())
    seen = []
    chunked = _feed(Watcher(t.layout), t.window(), seen.append, "x, ")
    assert whole and repr(chunked) == repr(whole)
    assert seen == [f"x, step {i}/230" for i in range(0, 230, evaluate.FEED_CHUNK)]


def test_a_case_scored_with_progress_is_the_case_scored_without():
    job = Job(64, 2, 4)
    seen = []
    assert run_case("slow_node", job, 1, 200, tick=seen.append) == run_case("slow_node", job, 1,
                                                                            200)
    assert seen


def test_quick_at_64_ranks_is_the_full_runs_first_trial_and_its_healthy_traces_shorter():
    assert evaluate.QUICK["trials"] == (1, 1, 1) and evaluate.FULL["trials"] == (20, 20, 5)
    assert evaluate.QUICK["steps"][:2] == evaluate.FULL["steps"][:2] == (400, 400)
    assert all(q[0] < f[0] for q, f in zip(evaluate.QUICK["healthy"], evaluate.FULL["healthy"]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_median_is_numpys_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    for shape in [(1,), (2,), (5,), (8,), (64,), (5, 4), (4, 6), (3, 2, 5)]:
        for trial in range(6):
            x = (rng.standard_normal(shape) * 10.0 ** int(rng.integers(-3, 3))).astype(dtype)
            if trial % 3 == 0:
                x.flat[int(rng.integers(x.size))] = np.nan
            if trial % 2:
                x = np.round(x, 1)  # ties
            for axis in [None, *range(-x.ndim, x.ndim)]:
                for keep in (False, True):
                    theirs = np.median(x, axis=axis, keepdims=keep)
                    ours = median(x, axis=axis, keepdims=keep)
                    assert type(ours) is type(theirs) and np.shape(ours) == np.shape(theirs)
                    assert np.asarray(ours).dtype == np.asarray(theirs).dtype
                    assert np.array_equal(ours, theirs, equal_nan=True), (shape, axis, keep)


def test_median_of_anything_else_is_numpys():
    assert median([3, 1, 2]) == 2.0 and isinstance(median([1, 2]), np.floating)
    assert median(np.array([4.0, 1.0, 2.0, 3.0])) == 2.5
