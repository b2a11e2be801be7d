"""Rank 0's plain progress lines (train/progress.py) when stdout is not a terminal."""

from __future__ import annotations

import io

from mscale.config.records import MetricsRecord
from mscale.train.progress import ProgressReporter


def _record(step: int, seconds: float) -> MetricsRecord:
    t = [seconds, seconds / 2]
    return MetricsRecord(step=step, loss=5.5, grad_norm=0.8, clip_threshold=1.0, lr=1e-3,
                         tokens=1000, tokens_per_s=1000 / seconds, step_time=t,
                         compute_time=t, comm_wait=t, data_time=t)


def _lines(log_interval: int, step_seconds: dict[int, float], steps: int = 100) -> list[str]:
    out = io.StringIO()
    with ProgressReporter(steps, enabled=True, log_interval=log_interval, stream=out) as p:
        for step in range(1, steps + 1):
            p.update(_record(step, step_seconds.get(step, 0.1)))
    return out.getvalue().splitlines()


def test_a_line_gives_the_pace_since_the_last_one_not_the_printed_steps_alone():
    """Every 50th step pauses for the synchronized GC (0.5 s here against 0.1 s): with
    --log-interval 50 every line was that step's, 2,000 tok/s in a run of ~9,300. With a line
    a step, each step is still its own."""
    lines = _lines(50, {50: 0.5, 100: 0.5})
    assert lines[0].startswith("step 50/100  loss 5.5000")
    assert lines[0].endswith("9,245 tok/s  step 0.108s (mean of 49 steps; step 1 left out: "
                             "warm-up)")
    assert lines[1].endswith("9,259 tok/s  step 0.108s (mean of 50 steps)") and len(lines) == 2
    lines = _lines(1, {2: 0.5}, steps=3)
    assert lines[1].endswith("2,000 tok/s  step 0.500s")
    assert len(lines) == 3 and "mean" not in "".join(lines)


def test_the_first_line_leaves_out_the_attempts_warm_up_step_as_the_summary_does():
    """Step 1 builds kernels and warms the allocator (3 s here against 0.1 s): the first line's
    mean of 10 steps read 2,564 tok/s in a run of 10,000; the closing summary leaves it out."""
    out = io.StringIO()
    with ProgressReporter(30, enabled=True, log_interval=10, stream=out) as p:
        for step in range(21, 31):  # a resumed attempt: its first step is 21
            p.update(_record(step, 3.0 if step == 21 else 0.1))
    assert out.getvalue().splitlines()[0].endswith(
        "10,000 tok/s  step 0.100s (mean of 9 steps; step 21 left out: warm-up)")
    lines = _lines(10, {1: 3.0}, steps=20)
    assert lines[1].endswith("10,000 tok/s  step 0.100s (mean of 10 steps)")
    assert _lines(1, {1: 3.0}, steps=2)[0].endswith("333 tok/s  step 3.000s")  # alone: shown
