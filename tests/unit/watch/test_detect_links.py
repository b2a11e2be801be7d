"""The slow-link rule (watch/detect/links.py): the node every slow group shares is named; work a
rank's timers do not trace, a trainer without the per-kind split, and a group that could be
either of two nodes name nobody."""

import numpy as np
import pytest

from mscale.watch.detect.evaluate import Job, run_case
from mscale.watch.detect.links import group_members, group_values
from mscale.watch.judge import Watcher
from mscale.watch.sim import Injection, generate
from mscale.watch.whatif import Grid


def feed(trace, drop_split: bool = False):
    win = trace.window()
    if drop_split:  # another trainer's records: no comm_tp / comm_pp / comm_dp
        win.ranks[:, 5:] = np.nan
    return Watcher(trace.layout).feed(win)


def links(found):
    return [f for f in found if f.cause == "slow_link"]


def test_groups_are_the_layouts_tp_and_dp_groups():
    g = Grid(generate(16, tp=2, pp=2, ranks_per_node=4, steps=1).layout)
    assert group_members(g, "tp").tolist()[:2] == [[0, 1], [2, 3]]
    assert group_members(g, "dp").tolist()[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    x = np.arange(16, dtype=float)[::-1].copy()  # the smallest member of each group
    assert group_values(g, "tp", x).tolist()[:2] == [14.0, 12.0]
    assert group_values(g, "dp", x).tolist()[:2] == [9.0, 8.0]


@pytest.mark.parametrize("target", [0, 13, 30, 63])
def test_the_slow_links_node_is_named_on_every_stage(target):
    t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=120, seed=5,
                 inject=[Injection("slow_link", 40, target)])
    (f,) = links(feed(t))
    node = t.layout.node_names[int(t.layout.node[target])]
    assert f.nodes == [node] and f.hardware and target in f.ranks
    assert 40 <= f.evidence["detected_at"] <= 46
    assert {s["kind"] for s in f.evidence["slow_groups"]} >= {"tp", "dp"}


def test_untraced_work_on_rank_0_is_not_a_slow_link():
    t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=120, seed=5,
                 inject=[Injection("host_work", 40, 0, magnitude=0.4)])
    assert links(feed(t)) == []


def test_without_the_split_the_rule_is_silent():
    t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=120, seed=5,
                 inject=[Injection("slow_link", 40, 13)])
    assert links(feed(t, drop_split=True)) == []


def test_a_dp_group_of_two_nodes_alone_names_neither():
    """tp 1, pp 1: the job's one DP group holds both nodes and has no peer group to be slower
    than; quarantining either node would be a coin toss."""
    t = generate(16, tp=1, pp=1, dp=16, ranks_per_node=8, steps=120, seed=5,
                 inject=[Injection("slow_link", 40, 3)])
    assert links(feed(t)) == []


def test_healthy_long_traces_name_no_link():
    for seed in range(3):
        t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=400, seed=seed,
                     flag_pauses=False)
        assert links(feed(t)) == []


def test_detection_rate_over_seeds():
    got = [run_case("slow_link", Job(64, 2, 4), seed, steps=150) for seed in range(10)]
    assert sum(o.detected and o.right_target for o in got) == 10
    assert all(o.early == 0 for o in got)


def test_a_stage_with_more_layers_has_slower_groups_but_no_slow_link():
    """Stages hold different layers: stage 0's TP groups run seven times the collectives of
    stage 1's. Groups are compared within their stage only."""
    t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=120, seed=5)
    stage0 = t.layout.pp_rank == 0
    t.comm_tp[:, stage0] *= 7
    t.comm_dp[:, stage0] *= 3
    assert links(feed(t)) == []


def test_leave_one_out_median_equals_the_median_of_the_others():
    from mscale.watch.detect.links import _leave_one_out_median

    rng = np.random.default_rng(0)
    for stages, k in [(1, 2), (2, 2), (3, 3), (2, 5), (4, 8), (1, 7)]:
        v = rng.random((5, stages * k))
        v[0] = 1.0  # ties
        per = v.reshape(5, stages, k)
        want = np.stack([np.median(np.delete(per, j, axis=-1), axis=-1) for j in range(k)],
                        axis=-1).reshape(5, -1)
        np.testing.assert_allclose(_leave_one_out_median(v, stages), want)
