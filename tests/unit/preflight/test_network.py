"""Which pairs preflight measures (exactly those the plan's groups connect), their rounds, and
two slowed ends of a pair (the `--inject-slow` hook) that do not compound their delays."""

from __future__ import annotations

from mscale.preflight.network import plan_pairs, rounds
from mscale.topology.placement import Placement


def test_pairs_are_the_plans_group_neighbours():
    p = Placement(tp=2, pp=2, dp=2, gpus_per_node=2)
    pairs = plan_pairs(p)
    assert {(a, b) for k, a, b in pairs if k == "tp"} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert {(a, b) for k, a, b in pairs if k == "dp"} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert {(a, b) for k, a, b in pairs if k == "pp"} == {(0, 4), (1, 5), (2, 6), (3, 7)}


def test_rings_close_and_pipelines_do_not():
    p = Placement(tp=1, pp=3, dp=4, gpus_per_node=4)
    pairs = plan_pairs(p)
    dp0 = p.dp_groups[0]
    assert ("dp", dp0[-1], dp0[0]) in pairs
    pp0 = p.pp_groups[0]
    assert [(a, b) for k, a, b in pairs if k == "pp" and a in pp0] == [(pp0[0], pp0[1]),
                                                                       (pp0[1], pp0[2])]


def test_rounds_never_put_a_rank_in_two_pairs_and_keep_every_pair():
    p = Placement(tp=4, pp=2, dp=4, gpus_per_node=8)
    pairs = plan_pairs(p)
    rs = rounds(pairs)
    assert sorted(x for r in rs for x in r) == sorted(pairs)
    for r in rs:
        ranks = [x for _, a, b in r for x in (a, b)]
        assert len(ranks) == len(set(ranks))


def test_two_slowed_peers_do_not_compound_their_delays(monkeypatch):
    """Each end's measured time includes waiting for the other's sleep; the hook's sleep must
    not grow with it (it did, geometrically, and hung srun with two slowed ranks of a pair)."""
    from mscale.preflight import compute

    clock = [0.0]
    monkeypatch.setattr(compute.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(compute.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    a, b = compute.Slowdown(4.0), compute.Slowdown(4.0)
    slept_b = 0.0
    for _ in range(10):
        t0 = clock[0]
        clock[0] += 0.001 + slept_b  # a's round trip: the work, plus b's last sleep
        before = clock[0]
        a.after(t0, "p2p")
        t0 = clock[0]
        clock[0] += 0.001 + (clock[0] - before)  # b's trip includes a's sleep
        before = clock[0]
        b.after(t0, "p2p")
        slept_b = clock[0] - before
    assert slept_b <= 0.0121  # bounded (3 x b's first trip); compounding gives ~3^10 x 1 ms
