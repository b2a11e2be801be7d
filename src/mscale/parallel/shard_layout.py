"""The data-parallel shard layout as pure functions of the plan: bucket size and shard order.

Three places need the same answers: the engine and the gradient buffer (`train/engine.py`,
`parallel/data.py`) size the buckets, the hierarchical reduction (`parallel/reduce.py`) decides
which shard each DP rank ends up owning, and the checkpoint (`ckpt/ownership.py`) derives, from a
plan alone, what any rank of any layout holds, to write it and to read it back. If two of them
computed these separately a change to one would make checkpoints land in the wrong shards without
any error, so each answer is one function here (tests/distributed/test_ckpt_layout.py checks the plan-only
layout against live engines, hierarchical DP included).
"""

from __future__ import annotations

from mscale.topology.placement import Placement

GRAD_ITEMSIZE = 4
"""Bytes per gradient element: the DP buffer is fp32 whatever the parameters' dtype."""


def bucket_bytes(training) -> int:
    """Bytes of gradient per DP bucket from ``training.bucket_mb`` (decimal megabytes)."""
    return int(training.bucket_mb * 1e6)


def bucket_numel(nbytes: int) -> int:
    """Gradient elements per bucket for a size in bytes (at least one: a bucket holds one
    parameter whatever its size)."""
    return max(1, nbytes // GRAD_ITEMSIZE)


def hierarchical_shard(intra_rank: int, inter_rank: int, inter_size: int) -> int:
    """The shard of every bucket that hierarchical ZeRO leaves at intra position ``intra_rank``
    on node ``inter_rank`` of ``inter_size`` nodes: the node-local reduce-scatter hands position
    ``i`` the contiguous run of shards ``i*n .. i*n+n-1``, the cross-node one hands node ``j`` the
    ``j``-th of those."""
    return intra_rank * inter_size + inter_rank


def shard_index(placement: Placement, rank: int, hierarchical: bool) -> int:
    """Which ZeRO shard ``rank`` owns in each bucket: its DP rank, permuted by
    `hierarchical_shard` when the reduction is hierarchical over more than one rank per node and
    more than one node (otherwise the reduction is flat, parallel/reduce.py `make_comm`)."""
    coord = placement.coord(rank)
    if not hierarchical or placement.dp == 1:
        return coord.dp
    intra, inter = placement.dp_hierarchy(placement.group_of(placement.dp_groups, rank))
    k, n = len(intra[0]), len(inter[0])
    if k == 1 or n == 1:
        return coord.dp
    i = next(sorted(g).index(rank) for g in intra if rank in g)
    j = next(sorted(g).index(rank) for g in inter if rank in g)
    return hierarchical_shard(i, j, n)


def owned_shard(placement: Placement, rank: int, zero_stage: int, hierarchical: bool) -> int | None:
    """The shard ``rank`` owns under ZeRO 1/2, or None under ZeRO 0 (it owns the whole buffer)."""
    return shard_index(placement, rank, hierarchical) if zero_stage > 0 else None
