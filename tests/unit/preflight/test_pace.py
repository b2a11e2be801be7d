"""How a link test is paced (preflight/pace.py): fewer timed iterations for a slow link, a test
cut short at its probes when they are far below the peers' figures, a healthy one never, and on
4 gloo processes every end of a slow rank's links cut short with every rank agreeing."""

from __future__ import annotations

import time

import pytest

from mscale.topology.placement import Placement


def test_a_slow_link_gets_fewer_timed_iterations_never_fewer_than_one():
    from mscale.preflight.pace import BUDGET_S, ITERS, MIN_ITERS, iterations

    assert iterations(0.008, "quick") == ITERS["quick"]          # a healthy 4 MB trip
    assert iterations(BUDGET_S["quick"] / 5, "quick") == 5       # five fit the budget
    assert iterations(1.6, "quick") == MIN_ITERS == 1            # 4 MB at 5 MB/s: 1.6 s a trip
    assert iterations(0.0, "full") == ITERS["full"]


def test_a_probe_far_below_the_expectation_cuts_the_test_short_a_healthy_one_never():
    from mscale.preflight.pace import BUDGET_S, FLOOR_S, ITERS, timed_iterations

    # healthy: a 1 ms probe of 1/8 of the size, against a 10 ms deadline or none at all
    assert timed_iterations(0.001, 8, 0.01, "quick") == ITERS["quick"]
    # a slow link: the full transfer would take 1.6 s, 10x past the deadline
    assert timed_iterations(0.2, 8, 0.16, "quick") == 0
    # under FLOOR_S nothing is cut, however far below (a descheduled moment on a shared core)
    assert timed_iterations(FLOOR_S / 8 * 0.9, 8, 0.001, "quick") > 0
    # no expectation yet: the budget is the deadline
    assert timed_iterations(BUDGET_S["quick"] / 8 * 1.1, 8, BUDGET_S["quick"], "quick") == 0
    assert timed_iterations(BUDGET_S["quick"] / 8 * 0.9, 8, BUDGET_S["quick"], "quick") == 1


def test_pace_expects_a_links_own_class_only():
    from mscale.preflight.pace import BUDGET_S, FLOOR_S, SLOW_FACTOR, Pace

    pace = Pace()
    assert pace.expected("p2p", True) is None
    assert pace.limit_s("p2p", True, 8 << 20, "quick") == BUDGET_S["quick"]
    pace.add("p2p", False, 2.0)
    pace.add("p2p", False, float("nan"))  # a turn this rank was not in: ignored
    assert pace.expected("p2p", True) is None  # one figure is no expectation
    pace.add("p2p", True, 10.0)
    assert pace.expected("p2p", True) is None  # never borrowed across the node boundary
    pace.add("p2p", True, 20.0)
    assert pace.expected("p2p", True) == 15.0 and pace.expected("allreduce", True) is None
    assert pace.limit_s("p2p", True, 15 * 10**9, "quick") == SLOW_FACTOR
    assert pace.limit_s("p2p", True, 1, "quick") == FLOOR_S


def _slowed(rank: int, world: int, slow_rank: int) -> dict:
    """On each of 4 gloo processes (tp 2 x dp 2 on two 2-process nodes): pairs and groups with
    one rank's operations stalled, against an expectation of 1 GB/s."""
    from datetime import timedelta

    import torch

    from mscale.distributed.groups import build_groups
    from mscale.preflight.compute import Slowdown
    from mscale.preflight.busbw import COLLECTIVES, measure_groups
    from mscale.preflight.network import measure_pairs
    from mscale.preflight.pace import Pace

    from mscale.preflight import pace as pace_module

    class Stall(Slowdown):
        """0.25 s more per timed operation, whatever the machine's speed: a probe then projects
        to ~2 s, over any limit here (a factor would leave a fast machine's under FLOOR_S)."""

        def after(self, t0, op="", alone=False):
            time.sleep(0.25)

    # A healthy link is cut short only if both its probes project over the floor; at load 14 on
    # two cores two descheduled probes of 31 ms reached the production 0.25 s, so the floor is
    # raised here (this process only) to 1 s: a probe must then take 125 ms twice.
    pace_module.FLOOR_S = 1.0

    placement = Placement(tp=2, pp=1, dp=2, gpus_per_node=2)
    groups = build_groups(placement, rank, timedelta(seconds=60))
    pace = Pace()
    for measure in ("p2p", *COLLECTIVES):
        for local in (True, False):
            pace.add(measure, local, 1.0)
            pace.add(measure, local, 1.0)
    slow = Stall() if rank == slow_rank else Slowdown(1.0)
    cpu = torch.device("cpu")
    pairs = measure_pairs(rank, placement, cpu, "quick", slow, pace=pace)
    grouped = measure_groups(groups, cpu, "quick", slow, pace=pace)
    return {"pairs": pairs, "groups": grouped, "seen": pace.seen}


@pytest.mark.dist
def test_a_slow_ranks_links_are_cut_short_on_every_end_and_every_rank_agrees():
    from mscale.distributed.spawn import run_distributed

    res = run_distributed(_slowed, 4, 3, timeout_s=60)
    for r in res:
        for it in r["pairs"] + r["groups"]:
            assert bool(it.get("cut_short")) == (3 in it["ranks"]), it
            if it.get("cut_short"):
                assert it["bytes"] < 4 << 20  # only the probes ran
    assert all(r["seen"] == res[0]["seen"] for r in res)  # the same expectation everywhere
