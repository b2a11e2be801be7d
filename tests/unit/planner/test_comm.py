"""Pipeline point-to-point cost: the critical-path count against the schedules themselves, and
the exposed time against hand values."""

import pytest

from mscale.parallel.pipeline.schedule import simulate
from mscale.planner.comm import Links, pp_critical_transfers, pp_exposed
from mscale.planner.constants import P2P_LATENCY_S

LINKS = Links(fast=100e9, nic=10e9, inter_pod=5e9, gpus_per_node=8, pod_gpus=1024)


@pytest.mark.parametrize("p,v,m,hand", [
    (8, 6, 32, 94),    # interleaved: 2·(p·v − 1) = 2·47 (MegaScale's 175B layout)
    (3, 32, 3, 190),   # one block per virtual stage of a 96-block model: 2·(96 − 1)
    (35, 3, 140, 208),  # MegaScale's 530B layout: 2·(105 − 1)
    (8, 1, 32, 68),    # 1F1B: 2·(p−1)·m/p + 2·(p−2) = 56 + 12
    (4, 1, 8, 16),     # 12 + 4
    (1, 1, 8, 0),      # no pipeline
])
def test_critical_transfers_by_hand(p, v, m, hand):
    assert float(pp_critical_transfers(p, v, m)) == pytest.approx(hand)


@pytest.mark.parametrize("p,v,m", [(2, 1, 8), (4, 1, 16), (8, 1, 8), (2, 4, 4), (4, 3, 8),
                                   (8, 6, 16), (3, 32, 6)])
def test_critical_transfers_match_the_schedule_simulation(p, v, m):
    """With asynchronous p2p and a transfer shorter than any chunk, each transfer of delay d adds
    exactly (critical transfers)·d to the simulated step of Megatron's schedule."""
    def step(d):
        tl = simulate(p, v, m, t_f=1.0 / v, t_b=2.0 / v, latency=d)
        return max(t[-1][2] for t in tl)

    d = 0.01 / v
    assert (step(d) - step(0.0)) / d == pytest.approx(float(pp_critical_transfers(p, v, m)))


def test_pp_exposed_by_hand():
    # 80 MB boundary activation over tp 8 = 10 MB per transfer; stages 1,536 ranks apart on a
    # 12,288-GPU job leave the 1,024-GPU pod: 5 GB/s → d = 2 ms + 20 µs per-transfer p2p latency
    d = 10e6 / 5e9 + P2P_LATENCY_S
    args = (80e6, 8, 8, 6, 32, 1536, LINKS)
    # chunk forward 10 ms > d: 94 critical transfers + (384 − 94)·(1 − 0.9) of the rest
    assert float(pp_exposed(*args, 0.010)) == pytest.approx((94 + 290 * 0.1) * d)
    # chunk forward 1 ms < d: the steady state leaks (d − 1 ms)/2 per transfer
    assert float(pp_exposed(*args, 0.001)) == pytest.approx(94 * d + 290 * (d - 0.001) / 2)
    # 1F1B: the critical count already covers the steady state
    assert float(pp_exposed(80e6, 8, 8, 1, 32, 1536, LINKS, 0.001)) == pytest.approx(
        (68 + 0) * d)


def test_deeper_interleaving_exposes_more_transfers():
    one = [float(pp_exposed(80e6, 8, 8, v, 32, 1536, LINKS, 0.010)) for v in (1, 2, 6, 12)]
    assert one[1] < one[2] < one[3]


def test_a_dp_ring_is_inside_a_pod_only_when_its_span_divides_the_pod():
    """Pods of 3 nodes (24 GPUs), DP groups of consecutive ranks from 0: groups of 16 GPUs put
    nodes 2-3 in one ring across the boundary (its slowest hop: the inter-pod share); groups of
    8 or 24 stay in. A partial last pod (4 nodes, pods of 3) needs nothing more."""
    from mscale.config import ClusterConfig
    from mscale.planner.comm import dp_half

    links = Links.of(ClusterConfig(nodes=4, nodes_per_pod=3, gpu="A100",
                                   inter_pod_gbit_per_s=50))
    assert links.pod_gpus == 24
    assert [bool(links.in_pod(s)) for s in (8, 16, 24, 32)] == [True, False, True, False]
    assert float(links.span_bandwidth(16)) == links.inter_pod < links.nic
    assert float(links.span_bandwidth(24)) == links.nic
    # hierarchical: the cross-node part of a 2-node group crossing pods runs inter-pod too
    flat_one_pod = Links.of(ClusterConfig(nodes=4, nodes_per_pod=4, gpu="A100",
                                          inter_pod_gbit_per_s=50))
    assert float(dp_half(1e9, 2, 8, links, True)) > float(dp_half(1e9, 2, 8, flat_one_pod, True))


def test_a_pod_larger_than_the_job_is_one_pod():
    from mscale.config import ClusterConfig

    links = Links.of(ClusterConfig(nodes=4, nodes_per_pod=6, gpu="A100"))
    assert links.pod_gpus == 32 and bool(links.in_pod(32))  # 4 of 6 nodes: no pod boundary


def test_a_ring_is_inside_a_node_only_when_its_span_divides_the_node():
    """Groups tile the ranks from 0: groups of 3 on 8-GPU nodes put ranks 6-8 across two."""
    links = Links(fast=100e9, nic=10e9, inter_pod=5e9, gpus_per_node=8, pod_gpus=1536)
    assert links.span_bandwidth(4) == links.fast and links.span_bandwidth(8) == links.fast
    assert links.span_bandwidth(3) == links.nic and links.span_bandwidth(6) == links.nic


def test_pipeline_transfers_use_nvlink_only_when_the_whole_pipeline_is_one_node():
    """Stages of 4 ranks on 8-GPU nodes: pp 2 is one node; at pp 4 the boundary between stages
    1 and 2 crosses nodes, and every micro-batch passes it."""
    def one_transfer(pp):
        # overlap 1: only the critical transfers are exposed, each one transfer time
        return pp_exposed(4e6, 1, pp, 1, 4, 4, LINKS, 1.0, overlap=1.0) / \
            pp_critical_transfers(pp, 1, 4)

    assert one_transfer(2) == pytest.approx(4e6 / LINKS.fast + P2P_LATENCY_S)
    assert one_transfer(4) == pytest.approx(4e6 / LINKS.nic + P2P_LATENCY_S)
