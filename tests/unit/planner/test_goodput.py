"""Young/Daly and the goodput model against hand values."""

import math

import pytest

from mscale.planner.constants import CHECKPOINT_BYTES_PER_PARAM
from mscale.planner.goodput import advise, effective_fraction, job_mtbf_s, young_daly


def test_young_daly():
    assert young_daly(10, 4 * 3600) == pytest.approx(math.sqrt(2 * 10 * 14400))


def test_default_rate_reproduces_llama3_interruption_interval():
    # Llama 3 (docs/references.md): one unexpected interruption every ~3.1 h on 16K GPUs = 2048 nodes
    assert job_mtbf_s(2048, 3.79) / 3600 == pytest.approx(3.1, abs=0.05)


def test_effective_fraction():
    # waste = C/τ + (τ/2 + R)/MTBF = 1/100 + (50 + 150)/10000 = 0.03
    assert effective_fraction(100, 1, 150, 10000) == pytest.approx(0.97)
    assert effective_fraction(100, 1, 1e9, 10) == 0.0


def test_advice_interval_is_whole_steps_and_at_least_the_write():
    params = 175e9
    a, note = advise(params, 12288, 1536, step_time_s=6.0)
    write = params * CHECKPOINT_BYTES_PER_PARAM / 273e9
    assert a.interval_s == pytest.approx(a.interval_steps * 6.0)
    assert a.interval_s >= write - 6.0
    assert 0 < a.effective_training < 1 and note
    slow, _ = advise(params, 12288, 1536, 6.0)
    fewer, _ = advise(params, 12288, 768, 6.0)
    assert fewer.mtbf_h == pytest.approx(2 * slow.mtbf_h, rel=1e-3)


def test_the_interval_never_outlasts_the_run():
    """A tiny failure rate once gave a 150-digit interval that train refused to read."""
    from mscale.planner.goodput import GoodputInputs

    rare = GoodputInputs(failures_per_1000_node_days=1e-100)
    a, note = advise(175e9, 12288, 1536, 6.0, rare, run_steps=5000)
    assert a.interval_steps == 5000 and a.interval_s == pytest.approx(5000 * 6.0)
    assert "capped at the run's 5000 steps" in note
    usual, note = advise(175e9, 12288, 1536, 6.0, run_steps=5000)
    assert usual.interval_steps < 5000 and "capped" not in note


def test_the_cap_at_the_run_never_makes_the_interval_shorter_than_one_write():
    """A run shorter than one checkpoint's write (a smoke test of a large model) capped the
    interval below the write time: the upload cannot finish within it, and preflight's storage
    need (a checkpoint per interval) asked the store for more than the planner assumed."""
    from mscale.planner.constants import CHECKPOINT_BYTES_PER_PARAM, STORAGE_WRITE_GB_PER_S

    write = 70e9 * CHECKPOINT_BYTES_PER_PARAM / (STORAGE_WRITE_GB_PER_S * 1e9)
    a, _ = advise(70e9, 512, 64, 0.5, run_steps=2)
    assert a.interval_s >= write
