"""Communication time: ring collectives on the fast domain and the network, and what overlap hides.

Ring costs as nccl-tests reports them (docs/references.md): reduce-scatter and all-gather move (n−1)/n of
the buffer per GPU, an all-reduce twice that. Bandwidths are unidirectional GB/s per GPU, scaled by
LINK_EFFICIENCY. All functions accept numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.config.cluster import ClusterConfig
from mscale.planner.constants import (HOP_LATENCY_S, LINK_EFFICIENCY, P2P_LATENCY_S, PP_OVERLAP,
                                      TP_OVERLAP)


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
    """GPUs of one pod, at most the job's (`Links.of`): pods start at rank 0, every
    ``pod_gpus`` ranks; the last may be partial (nodes need not be a multiple of the pod)."""

    @classmethod
    def of(cls, c: ClusterConfig) -> "Links":
        e = LINK_EFFICIENCY * 1e9
        return cls(fast=c.domain_gb_per_s * e, nic=c.node_gb_per_s / c.gpus_per_node * e,
                   inter_pod=c.inter_pod_node_gb_per_s / c.gpus_per_node * e,
                   gpus_per_node=c.gpus_per_node,
                   pod_gpus=min(c.pod_nodes, c.num_nodes) * c.gpus_per_node)

    def in_pod(self, span_gpus):
        """Whether every group of ``span_gpus`` consecutive ranks (groups tile the ranks from 0,
        as DP groups do in tp-dp-pp order) lies inside one pod: the span divides the pod. A
        span that does not has a group across the first pod boundary below the job's end, and
        a ring runs at its slowest hop (pods of 3 nodes, DP groups of 2: nodes 2-3 cross). A
        partial last pod needs nothing more: spans divide the job and the pod, so its remainder
        too."""
        return self.pod_gpus % np.asarray(span_gpus) == 0

    def in_node(self, span_gpus):
        """Whether every group of ``span_gpus`` consecutive ranks (tiling the ranks from 0) lies
        inside one node: the span divides the node. Smaller is not enough: groups of 3 on
        8-GPU nodes put ranks 6-8 across two nodes, and a ring runs at its slowest hop."""
        return self.gpus_per_node % np.asarray(span_gpus) == 0

    def span_bandwidth(self, span_gpus):
        """Bandwidth of a ring over ``span_gpus`` consecutive ranks: its slowest tier."""
        span_gpus = np.asarray(span_gpus)
        return np.where(self.in_node(span_gpus), self.fast,
                        np.where(self.in_pod(span_gpus), self.nic, self.inter_pod))


def ring_half(nbytes, n, bandwidth):
    """Seconds for a ring reduce-scatter or all-gather of ``nbytes`` over ``n`` members."""
    n = np.asarray(n)
    return np.where(n > 1, (n - 1) / n * nbytes / bandwidth + (n - 1) * HOP_LATENCY_S, 0.0)


def dp_half(nbytes, dp, tp, links: Links, hierarchical):
    """Seconds for half a data-parallel all-reduce (a reduce-scatter or an all-gather).

    Flat: one ring over the DP group at its slowest tier. Hierarchical (docs/references.md): reduce-scatter
    among the k DP members inside a node on NVLink, then the ring across the nodes on a 1/k shard,
    each of the k GPUs using its own NIC share.
    """
    dp, tp = np.asarray(dp), np.asarray(tp)
    span = dp * tp  # consecutive ranks a DP group covers (tp-dp-pp order)
    flat = ring_half(nbytes, dp, links.span_bandwidth(span))
    k = np.clip(links.gpus_per_node // tp, 1, None)
    k = np.minimum(k, dp)
    nodes = np.maximum(dp // k, 1)
    inter_bw = np.where(links.in_pod(span), links.nic, links.inter_pod)
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


def tp_exposed(act_bytes, tp, links: Links, collectives, overlap: float = TP_OVERLAP):
    """Exposed seconds of TP/SP communication for the given number of all-gathers/reduce-scatters
    of one activation (s·b·h elements) each; ``overlap`` of it hides behind GEMMs (the stack's
    `tp_overlap`: MegaScale's TP_OVERLAP, none for stacks with synchronous collectives)."""
    return (1 - overlap) * collectives * ring_half(act_bytes, tp, links.fast)


def pp_critical_transfers(pp, vpp, m):
    """Pipeline transfers per step that lie on the critical path even when every send/recv is
    asynchronous and overlaps compute.

    Measured on the schedules themselves (`mscale.parallel.pipeline.schedule.simulate`, Megatron's
    1F1B and interleaved 1F1B, with a fixed delay per transfer; see tests/unit/planner/test_cost.py):

    - interleaved 1F1B (v > 1): ``2·(p·v − 1)``. The first micro-batch crosses all p·v − 1
      virtual-stage boundaries forward before the last virtual stage can start the first backward,
      and the same boundaries backward at the end; nothing else can run meanwhile (that is the
      fill/drain bubble). Deeper interleaving adds p boundaries per extra chunk to this chain:
      this is where the v-fold communication of Narayanan et al. 2021 (§2.2.2) cannot be hidden.
    - 1F1B (v = 1): ``2·(p−1)·m/p + 2·(p−2)``. Its steady state has no slack: each forward waits
      for the activation the previous rank sent right after its own backward, so nearly every
      transfer is exposed (Megatron-LM overlaps p2p communication only in the interleaved
      schedule, ``--overlap-p2p-comm``).
    """
    pp, vpp, m = np.asarray(pp), np.asarray(vpp), np.asarray(m)
    crit = np.where(vpp > 1, 2.0 * (pp * vpp - 1), 2.0 * (pp - 1) * m / pp + 2.0 * (pp - 2))
    return np.where(pp > 1, crit, 0.0)


def pp_exposed(act_bytes, tp, pp, vpp, m, span_gpus, links: Links, t_fwd_chunk,
               overlap: float = PP_OVERLAP):
    """Exposed seconds of pipeline send/recv per step.

    Each transfer carries one micro-batch's boundary activation (or its gradient) split over the
    TP ranks (Megatron's scatter/gather), ``d = bytes / bandwidth + HOP_LATENCY_S``. A rank sends
    and receives 2·v·m of them per step (forward and backward, per chunk; Narayanan et al. 2021
    §2.2.2: interleaving multiplies the communication by v).

    - ``pp_critical_transfers`` of them are on the critical path whatever the overlap: fully exposed.
    - The others overlap compute. (1 − overlap) of each stays exposed (the stack's
      `pp_overlap`, PP_OVERLAP for MegaScale) (send/recv kernels compete
      with compute), and once ``d`` exceeds the forward time of one chunk ``t_fwd_chunk`` the
      interleaved steady state cannot hide it any more: ``(d − t_fwd_chunk)/2`` per transfer is
      exposed (fitted to the schedule simulation: within 0–13% above it; 1F1B's critical count
      already covers its steady state, linear in d).

    ``span_gpus`` is how many consecutive ranks one stage covers (tp·dp): every micro-batch
    crosses every stage boundary, so the transfers run on NVLink only when the whole pipeline
    (span·pp ranks) is one node; otherwise some boundary is a network hop, and it paces them.
    """
    pp = np.asarray(pp)
    bw = np.where(np.asarray(span_gpus) * pp <= links.gpus_per_node, links.fast,
                  np.where(np.asarray(span_gpus) * pp <= links.pod_gpus, links.nic, links.inter_pod))
    one = act_bytes / tp / bw + P2P_LATENCY_S
    crit = pp_critical_transfers(pp, vpp, m)
    vpp = np.asarray(vpp)
    steady = np.maximum(2 * vpp * np.asarray(m) - crit, 0)
    late = np.where(vpp > 1, (one - np.asarray(t_fwd_chunk)) / 2, 0.0)  # 1F1B: already in crit
    per_steady = np.maximum((1 - overlap) * one, late)
    return np.where(pp > 1, crit * one + steady * per_steady, 0.0)
