"""The step replay (watch/replay.py) against the schedule's own simulator, and the split search
that uses it (detect/split.py: fastest_split)."""

import numpy as np
import pytest

from mscale.parallel.pipeline.schedule import simulate
from mscale.watch.detect.split import best_split, fastest_split
from mscale.watch.replay import MAX_MICRO_BATCHES, replay, schedulable, step_graph


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 2), (2, 1, 5), (4, 1, 8), (4, 2, 8), (3, 3, 6),
                                      (8, 1, 16)])
def test_replay_equals_the_schedule_simulator_for_any_stage_costs(pp, vpp, m):
    rng = np.random.default_rng(pp * 100 + vpp * 10 + m)
    busy = rng.uniform(0.5, 3.0, (5, pp))  # five replicas, each its own stage times
    got = replay(step_graph(pp, vpp, m), busy)
    for row, b in zip(got, busy):
        per = b / (3 * m * vpp)  # a backward costs two forwards, per micro-batch and chunk
        want = max(r[-1][2] for r in simulate(pp, vpp, m, per, 2 * per))
        assert row == pytest.approx(want, rel=1e-12)


def test_every_action_comes_after_its_inputs():
    g = step_graph(4, 2, 8)
    level = np.empty(g.actions + 1, int)
    level[g.actions] = -1
    for d, (idx, prev, dep) in enumerate(g.levels):
        level[idx] = d
    for d, (idx, prev, dep) in enumerate(g.levels):
        assert (level[prev] < d).all() and (level[dep] < d).all()
    assert sorted(np.concatenate([i for i, _, _ in g.levels]).tolist()) == list(range(g.actions))
    assert g.weight.sum() == pytest.approx(4)  # each rank's actions share all of its time


def test_micro_batch_counts_are_made_schedulable():
    assert schedulable(4, 1, 2.6) == 4            # at least pp
    assert schedulable(4, 2, 9.0) == 12           # interleaved: a multiple of pp
    assert schedulable(2, 1, 1e9) == MAX_MICRO_BATCHES


def test_a_heavy_stage_replays_faster_first_than_in_the_middle():
    # two splits with the same slowest stage: the schedule hides a heavy first stage better
    g = step_graph(4, 1, 8)
    assert replay(g, np.array([5.0, 4.2, 4.0, 4.0])) < replay(g, np.array([4.0, 4.2, 5.0, 4.0]))


def test_fastest_split_picks_the_tied_split_the_schedule_prefers():
    stage_s = np.array([4.0, 5.6, 4.0, 4.0])  # 4 blocks each, stage 1's 40% heavier
    greedy, c = best_split(stage_s, [4, 4, 4, 4])
    split, _ = fastest_split(stage_s, [4, 4, 4, 4], step_graph(4, 1, 8))
    assert split[1] == 3 and greedy[1] == 3
    fixed = stage_s - 4 * c
    g = step_graph(4, 1, 8)
    assert replay(g, fixed + np.array(split) * c) <= replay(g, fixed + np.array(greedy) * c)
    assert split == [5, 3, 4, 4]
    assert fastest_split(np.array([1.0, 1.0]), [2, 2], step_graph(2, 1, 4))[0] == [2, 2]
