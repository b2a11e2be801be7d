"""A degraded NIC as it really is (watch/detect/links.py): only traffic that leaves its node is
slow, so TP groups inside a node stay fast and the evidence is the DP groups and pipeline pairs
that cross it. Synthetic per-rank records, shaped like those of the 8-process CPU job with one
pretend node's cross-node sends paced (tests/faults/slowlink.c, docs/watch.md "Rehearse it on
one machine"): every DP group and pipeline pair through the node waits, its members alike."""

import numpy as np
import pytest

from mscale.watch.config import WatchConfig
from mscale.watch.detect.links import LinkRows, LinkRules
from mscale.watch.sim import Injection, generate
from mscale.watch.whatif import Grid

ROWS = 16


def layout(world: int, tp: int, pp: int, per_node: int = 2):
    return generate(world, tp=tp, pp=pp, ranks_per_node=per_node, steps=1).layout


def judge(lay, slow_ranks: set[int], dp_s: float = 0.6, pp_s: float = 0.3, seed: int = 0):
    """The link findings over ``ROWS`` rows in which every DP group and pipeline pair with a
    member in ``slow_ranks`` (whose NIC is slow) waits ``dp_s`` / ``pp_s`` more, every member."""
    g, rng = Grid(lay), np.random.default_rng(seed)
    ranks = np.arange(g.world).reshape(g.pp, g.dp, g.tp)
    rows = LinkRows(g, ROWS)
    for step in range(ROWS):
        tp = 0.25 + 0.03 * rng.random(g.world)  # NVLink inside the node: untouched
        dp = 0.02 * rng.random(g.world)
        pp = 0.05 + 0.05 * rng.random(g.world)
        for s in range(g.pp):
            for t in range(g.tp):
                group = ranks[s, :, t]
                if slow_ranks & set(group.tolist()):
                    dp[group] += dp_s * (1 + 0.1 * rng.random())
        for s in range(g.pp - 1):
            for pair in np.stack([ranks[s], ranks[s + 1]], axis=-1).reshape(-1, 2):
                if slow_ranks & set(pair.tolist()):
                    pp[pair] += pp_s * (1 + 0.1 * rng.random())
        active = 0.9 + 0.03 * rng.random(g.world)  # a NIC lengthens waits, not own work
        rows.append(100 + step, 1.2, {"tp": tp, "pp": pp, "dp": dp}, active)
    return [f for f in LinkRules(g, WatchConfig()).judge(rows) if f.cause == "slow_link"]


@pytest.mark.parametrize("node", [0, 1, 2, 3])
def test_the_demo_layout_names_the_node_whose_nic_is_slow(node):
    """tp2 pp2 dp2 on four nodes of two: a node is one TP group (fast), both DP groups of its
    stage cross it and its stage peer (so they are only slower than the other stage's), and its
    pipeline pairs join it to the node of its replica in the other stage. Before, no kind saw a
    group slower than its stage's peers and watch named nobody."""
    lay = layout(8, tp=2, pp=2)
    slow = set(np.flatnonzero(lay.node == node).tolist())
    (f,) = judge(lay, slow)
    assert f.nodes == [lay.node_names[node]] and f.hardware and f.ranks == sorted(slow)
    assert {s["kind"] for s in f.evidence["slow_groups"]} == {"dpx", "pp"}


def test_one_nic_of_a_two_node_dp_group_lists_both_nodes_and_names_neither():
    """tp2 dp2 on two nodes, rank 3's NIC slow (one NIC a GPU): its DP group is slower than
    the other, and both nodes are in it. The finding says so, names no node (nothing is
    quarantined) and tells the operator how to separate them."""
    lay = layout(4, tp=2, pp=1)
    (f,) = judge(lay, {3})
    assert f.nodes == [] and f.ranks == []
    assert f.evidence["suspects"] == ["node0", "node1"]
    assert "one of node0, node1" in f.message and "no node is named" in f.message
    assert "`mscale preflight`" in f.advice
    assert "over node0, node1 and at least two more nodes" in f.advice


def test_a_nic_every_group_crosses_alike_is_no_link_finding():
    """tp2 dp4 on four nodes (pp 1): both DP groups hold a rank of every node, so a slow NIC
    slows them alike and no group is slower than another: not a link finding (the job-wide
    rule reports it, and says to run preflight: test_detect_stragglers.py)."""
    lay = layout(8, tp=2, pp=1)
    assert judge(lay, {4, 5}) == []


def test_a_slow_device_raises_pipeline_waits_but_is_no_slow_link():
    """A pipeline pair alone never names a link: a slow device raises its pipeline's waits."""
    t = generate(8, tp=2, pp=2, ranks_per_node=2, steps=120, seed=3,
                 inject=[Injection("slow_device", 40, 5)])
    from mscale.watch.judge import Watcher

    found = Watcher(t.layout).feed(t.window())
    assert not [f for f in found if f.cause == "slow_link"]


# (world, pp, the late rank, the ranks of the slow pairs, the healthy node they point at)
LATE = {"two stages away": (48, 3, 32, [0, 1, 16, 17], "node0"),
        "at the pair's end": (8, 2, 7, [2, 3, 6, 7], "node1")}


@pytest.mark.parametrize("where", sorted(LATE))
@pytest.mark.parametrize("cause", ["slow device", "NIC"])
def test_pairs_waiting_on_a_late_rank_of_their_pipeline_name_no_node(cause, where):
    """tp2 on nodes of two, stage 0 reducing more bytes than the others (embedding: its DP
    groups are slower than every other stage's, a healthy ``dpx`` excess) and one rank slow
    (pp3 dp8: rank 32, stage 2 of replica 0; pp2 dp2: rank 7, stage 1 of replica 1): its
    pipeline's pairs at a boundary wait on it, more than their boundary's other pairs. Before,
    the pairs and the heavy stage agreed on a healthy node of stage 0, and watch named it a slow
    link. The slow rank spends longer on its own work (its step less its waits) than its
    stage's peers, so the pairs are explained; where no rank does (the same waits from a NIC on
    that node), the node is named."""
    world, pp, late, paired, node = LATE[where]
    lay = layout(world, tp=2, pp=pp)
    g, rng = Grid(lay), np.random.default_rng(0)
    rows = LinkRows(g, ROWS)
    for step in range(ROWS):
        tp = 0.05 + 0.01 * rng.random(world)
        dp = 0.06 + 0.01 * rng.random(world)
        dp[: world // pp] += 0.1  # stage 0's heavier reduction, every replica alike
        pp_wait = 0.13 + 0.02 * rng.random(world)
        pp_wait[paired] += 0.12
        active = 1.0 + 0.03 * rng.random(world)
        if cause == "slow device":
            active[late] += 0.3
        rows.append(100 + step, 1.5, {"tp": tp, "pp": pp_wait, "dp": dp}, active)
    found = [f for f in LinkRules(g, WatchConfig()).judge(rows) if f.cause == "slow_link"]
    assert [f.nodes for f in found] == ([] if cause == "slow device" else [[node]])
