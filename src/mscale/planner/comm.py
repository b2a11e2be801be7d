"""Communication time: ring collectives on the fast domain and the network, and what overlap hides.

Ring costs as nccl-tests reports them (facts.md): reduce-scatter and all-gather move (n−1)/n of
the buffer per GPU, an all-reduce twice that. Bandwidths are unidirectional GB/s per GPU, scaled by
LINK_EFFICIENCY. All functions accept numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.config.cluster import ClusterConfig
from mscale.planner.constants import HOP_LATENCY_S, LINK_EFFICIENCY, PP_OVERLAP, TP_OVERLAP


@dataclass(frozen=True)
class Links:
    """Bytes/s per GPU on each tier of a cluster, as collectives can use them."""

    fast: float
    """Inside the fast domain (NVLink)."""
    nic: float
    """Between nodes of one pod: the node's NIC bandwidth shared by its GPUs."""
    inter_pod: float
    """Leaving the pod (oversubscribed spines)."""
    gpus_per_node: int
    pod_gpus: int

    @classmethod
    def of(cls, c: ClusterConfig) -> "Links":
        e = LINK_EFFICIENCY * 1e9
        return cls(fast=c.domain_gb_per_s * e, nic=c.node_gb_per_s / c.gpus_per_node * e,
                   inter_pod=c.inter_pod_node_gb_per_s / c.gpus_per_node * e,
                   gpus_per_node=c.gpus_per_node, pod_gpus=c.pod_nodes * c.gpus_per_node)

    def span_bandwidth(self, span_gpus):
        """Bandwidth of a ring over ``span_gpus`` consecutive ranks: its slowest tier."""
        span_gpus = np.asarray(span_gpus)
        return np.where(span_gpus <= self.gpus_per_node, self.fast,
                        np.where(span_gpus <= self.pod_gpus, self.nic, self.inter_pod))


def ring_half(nbytes, n, bandwidth):
    """Seconds for a ring reduce-scatter or all-gather of ``nbytes`` over ``n`` members."""
    n = np.asarray(n)
    return np.where(n > 1, (n - 1) / n * nbytes / bandwidth + (n - 1) * HOP_LATENCY_S, 0.0)


def dp_half(nbytes, dp, tp, links: Links, hierarchical):
    """Seconds for half a data-parallel all-reduce (a reduce-scatter or an all-gather).

    Flat: one ring over the DP group at its slowest tier. Hierarchical (facts.md): reduce-scatter
    among the k DP members inside a node on NVLink, then the ring across the nodes on a 1/k shard,
    each of the k GPUs using its own NIC share.
    """
    dp, tp = np.asarray(dp), np.asarray(tp)
    span = dp * tp  # consecutive ranks a DP group covers (tp-dp-pp order)
    flat = ring_half(nbytes, dp, links.span_bandwidth(span))
    k = np.clip(links.gpus_per_node // tp, 1, None)
    k = np.minimum(k, dp)
    nodes = np.maximum(dp // k, 1)
    inter_bw = np.where(span <= links.pod_gpus, links.nic, links.inter_pod)
    hier = ring_half(nbytes, k, links.fast) + ring_half(nbytes / k, nodes, inter_bw)
    return np.where(np.asarray(hierarchical, dtype=bool) & (k > 1) & (nodes > 1), hier, flat)


def dp_exposed(half, zero, overlap, t_fwd_mb, t_bwd_mb):
    """Exposed seconds of the DP reduction per step.

    With overlap (MegaScale §3.2): gradients of a micro-batch are reduced while the last micro-batch's
    backward runs, and under ZeRO the parameter all-gather is prefetched during the first forward.
    Without ZeRO the whole all-reduce (two halves) must fit behind the last backward.
    """
    zero = np.asarray(zero)
    if not overlap:
        return 2 * half
    sharded = np.maximum(half - t_bwd_mb, 0) + np.maximum(half - t_fwd_mb, 0)
    replicated = np.maximum(2 * half - t_bwd_mb, 0)
    return np.where(zero >= 1, sharded, replicated)


def tp_exposed(act_bytes, tp, links: Links, collectives):
    """Exposed seconds of TP/SP communication for the given number of all-gathers/reduce-scatters
    of one activation (s·b·h elements) each; TP_OVERLAP of it hides behind GEMMs."""
    return (1 - TP_OVERLAP) * collectives * ring_half(act_bytes, tp, links.fast)


def pp_exposed(act_bytes, tp, pp, vpp, m, span_gpus, links: Links):
    """Exposed seconds of pipeline send/recv per step.

    Each transfer carries one micro-batch's boundary activation split over the TP ranks (Megatron's
    scatter/gather). Steady state: 2·v·m transfers (forward and backward, per chunk), PP_OVERLAP of
    them hidden; warm-up and cool-down: 2·(p−1) transfers on the critical path, never hidden.
    ``span_gpus`` is how many consecutive ranks one stage covers (tp·dp): neighbours farther apart
    than a node talk over the network.
    """
    pp = np.asarray(pp)
    bw = np.where(np.asarray(span_gpus) < links.gpus_per_node, links.fast,
                  np.where(np.asarray(span_gpus) * pp <= links.pod_gpus, links.nic, links.inter_pod))
    one = act_bytes / tp / bw + HOP_LATENCY_S
    exposed = (1 - PP_OVERLAP) * 2 * vpp * m * one + 2 * (pp - 1) * one
    return np.where(pp > 1, exposed, 0.0)
