"""The what-if step model: TP groups at their slowest member, stages along the pipeline,
replicas at the slowest one; and its slowdowns against the true ones of simulated faults."""

import numpy as np
import pytest

from mscale.parallel.pipeline.schedule import simulate
from mscale.watch.layout import JobLayout
from mscale.watch.sim import Injection, generate
from mscale.watch.whatif import Grid, WhatIf, estimate_micro_batches, model_step


def grid(tp, pp, dp, rpn=8):
    return Grid(JobLayout.from_flags(tp, pp, dp, min(rpn, tp * pp * dp)))


def pipeline(stages, m):
    """One replica's step by the schedule's own simulator (a backward twice a forward)."""
    per = np.asarray(stages) / (3 * m)
    return max(r[-1][2] for r in simulate(len(stages), 1, m, per, 2 * per))


def test_model_step_by_hand():
    g = grid(2, 2, 2)
    # ranks in (pp, dp, tp) order
    own = np.array([[1.0, 1.2, 1.0, 1.0, 2.0, 2.0, 1.5, 3.0]])
    # TP groups at their slowest: replica 0 has stages 1.2, 2.0; replica 1 has 1.0, 3.0
    assert model_step(own, g, 4) == pytest.approx([pipeline([1.0, 3.0], 4)])
    assert pipeline([1.0, 3.0], 4) == pytest.approx(3.0 + 1.0 / 4)  # the slow stage is last
    # the slow stage first: its forwards start at once, and the light stage's last backward
    # trails it: the same closed formula
    assert model_step(own[:, [4, 5, 6, 7, 0, 1, 2, 3]], g, 4) == pytest.approx(
        [pipeline([3.0, 1.0], 4)])
    assert model_step(own, g, 1) == pytest.approx(model_step(own, g, 2))  # m < pp: as the least


def test_one_slow_cell_is_partly_hidden_by_the_schedule():
    # pp 4, dp 4, one (stage, replica) cell at 45 s where its peers take 19.5 s, 8 micro-batches:
    # the closed formula max + (sum - max) / m says 95% slower; the schedule hides more of it
    g = grid(1, 4, 4)
    own = np.full((1, 16), 19.5)
    own[0, 1 * 4 + 2] = 45.0  # stage 1, replica 2
    pct = 100 * (model_step(own, g, 8)[0] / model_step(np.full((1, 16), 19.5), g, 8)[0] - 1)
    assert pct == pytest.approx(100 * (pipeline([19.5, 45, 19.5, 19.5], 8)
                                       / pipeline([19.5] * 4, 8) - 1))
    assert 78 < pct < 84


def test_micro_batches_recovered_from_the_bubble():
    t = generate(64, tp=2, pp=4, steps=60, seed=1, micro_batches=6)
    g = Grid(t.layout)
    m = estimate_micro_batches(t.compute + t.data, t.bubble, g)
    assert m == pytest.approx(6, rel=0.15)
    assert estimate_micro_batches(t.compute, t.bubble, grid(2, 1, 32)) is None


@pytest.mark.parametrize("cause,target", [("slow_device", 21), ("slow_data", 18),
                                          ("slow_node", 3)])
def test_slowdown_matches_the_true_one(cause, target):
    kw = dict(world=64, tp=2, pp=4, ranks_per_node=8, steps=80, seed=2)
    healthy = generate(**kw)
    t = generate(**kw, inject=[Injection(cause, 1, target)])
    g = Grid(t.layout)
    whatif = WhatIf(g, estimate_micro_batches(healthy.compute, healthy.bubble, g))
    ranks = np.flatnonzero(t.layout.node == target) if cause == "slow_node" else [target]
    rows = slice(10, None)
    c, d = t.compute[rows], t.data[rows]
    # a typical rank of the stage: the median of the ranks outside the suspects (a node is half
    # of a stage here, where the plain median is no longer typical)
    others = np.where(np.isin(np.arange(64), ranks), np.nan, c).reshape(len(c), 4, 16)
    typical = g.per_rank(np.nanmedian(others, axis=-1))
    fixed = whatif.typical_ranks(c, d, ranks, typical)
    pct, saved = whatif.slowdown(c + d, fixed, t.step_time[rows])
    true = 100 * (np.median(t.step_time[rows, 0]) / np.median(healthy.step_time[rows, 0]) - 1)
    assert pct == pytest.approx(true, abs=2.5)
    assert saved > 0.1  # not a trivial case: the pipeline hides about half of the 0.3 s


def test_stage_what_if_does_not_credit_a_straggler_inside_the_stage():
    g = grid(1, 2, 3)
    compute = np.array([[1.0, 1.0, 1.0, 1.5, 1.5, 2.5]])  # stage 1 heavy, rank 5 slower still
    data = np.zeros_like(compute)
    whatif = WhatIf(g, 1e9)  # replica = its slowest stage
    fixed = whatif.typical_stage(compute, data, 1)
    assert fixed.tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 2.0]]
    pct, saved = whatif.slowdown(compute + data, fixed, np.array([2.5]))
    assert saved == pytest.approx(0.5) and pct == pytest.approx(25.0)
    # the device alone, made typical within its stage
    pct, saved = whatif.slowdown(compute, whatif.typical_ranks(compute, data, [5]),
                                 np.array([2.5]))
    assert saved == pytest.approx(1.0)


def test_rebalancing_removes_a_replicas_shift_and_keeps_rank_noise():
    g = grid(2, 1, 3)
    compute = np.array([[1.0, 1.1, 1.6, 1.7, 1.0, 1.05]])  # replica 1 +0.6 on both TP ranks
    fixed = WhatIf(g, 1).typical_all(compute, np.zeros_like(compute))
    assert fixed == pytest.approx(np.array([[1.0, 1.1, 1.0, 1.1, 1.0, 1.05]]))


def test_saving_to_percent():
    assert WhatIf.from_saving(0.5, 2.5) == (25.0, 0.5)
    assert WhatIf.from_saving(-0.1, 2.5) == (0.0, 0.0)
    assert WhatIf.from_saving(3.0, 2.5) == (0.0, 0.0)
