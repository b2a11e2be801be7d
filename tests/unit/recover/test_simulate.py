"""The failure simulation against arithmetic that must hold (docs/recover-simulation.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mscale.errors import MscaleError
from mscale.recover.simulate import SimInputs, estimate, for_model, simulate


def test_without_failures_only_the_snapshots_cost():
    inp = SimInputs(failures_per_1000_node_days=1e-9, interval_s=100.0, snapshot_s=5.0, days=2)
    r = simulate(inp)
    assert r.failures == 0 and r.lost_work_s == 0
    assert r.ett == pytest.approx(100 / 105, rel=1e-3)


def test_failure_count_follows_the_job_rate():
    inp = SimInputs(days=60)
    est = estimate(inp, seeds=20)
    expected = inp.days * 86400 / inp.mtbf_s  # ~350 at 1,536 nodes
    assert est.failures_mean == pytest.approx(expected, rel=0.05)


def test_agrees_with_young_daly_when_recovery_is_short_against_the_mtbf():
    inp = SimInputs(detect_s=10, diagnose_s=0, restart_s=60, upload_s=0, auto_fraction=1.0)
    est = estimate(inp, seeds=20)
    assert est.ett_mean == pytest.approx(est.analytic, abs=0.005)


def test_the_young_daly_interval_beats_a_much_longer_or_shorter_one():
    base = SimInputs(detect_s=10, diagnose_s=0, restart_s=60, upload_s=0, auto_fraction=1.0)
    best = estimate(base, seeds=10).ett_mean
    tau = base.chosen_interval_s()
    for other in (tau / 8, tau * 8):
        assert estimate(replace(base, interval_s=other), seeds=10).ett_mean < best


def test_work_since_the_last_durable_checkpoint_is_lost():
    # An upload longer than the interval: a failure falls back further than the last snapshot.
    fast = SimInputs(upload_s=0.0, interval_s=600.0)
    slow = replace(fast, upload_s=1200.0)
    assert simulate(slow).lost_work_s > simulate(fast).lost_work_s


def test_slower_recovery_never_helps():
    base = SimInputs(days=7)

    def ett(detect: float, restart: float) -> float:
        inp = replace(base, detect_s=detect, diagnose_s=0.0, restart_s=restart)
        return estimate(inp, 3).ett_mean

    assert ett(10.0, 60.0) > ett(10.0, 1800.0)
    assert ett(10.0, 60.0) > ett(1800.0, 60.0)


def test_model_sized_checkpoints_use_the_planner_bandwidths():
    inp = for_model(175e9)
    assert 0 < inp.snapshot_s < 1  # each of 12,288 GPUs copies ~0.2 GB
    assert 5 < inp.upload_s < 20  # ~2.4 TB at 273 GB/s
    assert inp.chosen_interval_s() >= inp.upload_s


@pytest.mark.parametrize("field,value", [("gpus", 0), ("auto_fraction", 1.5), ("detect_s", -1),
                                         ("interval_s", 0.0), ("days", float("nan"))])
def test_bad_inputs_are_refused_by_name(field, value):
    with pytest.raises(MscaleError) as e:
        SimInputs(**{field: value})
    assert e.value.field == field
