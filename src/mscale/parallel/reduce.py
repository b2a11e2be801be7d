"""How one bucket is reduced over the DP group, and how updated shards are gathered back.

Three strategies with the same two calls, each returning a handle with ``wait()``:

- `LocalComm` (DP size 1): no communication; copies where a shard is expected.
- `FlatComm`: one asynchronous collective per bucket on the whole DP group (all-reduce for
  ZeRO 0, reduce-scatter for ZeRO 1/2; all-gather for the parameters).
- `HierarchicalComm`: reduce-scatter inside the node, then all-reduce (ZeRO 0) or reduce-scatter
  (ZeRO 1/2) of that chunk across nodes, then (ZeRO 0) all-gather inside the node. The three
  steps depend on each other, and two async ops on *different* groups have no order that all
  ranks agree on, so the chain of every bucket runs on one worker thread, buckets in order: all
  ranks then issue the same collectives in the same order on each group, and the chain still
  overlaps backward. Blocking collectives release the GIL while they wait.

Shard numbering under hierarchical ZeRO: with ``k`` DP ranks per node and ``n`` nodes, the rank
at intra position ``i`` on node ``j`` owns shard ``i*n + j`` of each bucket: the intra
reduce-scatter hands position ``i`` the contiguous chunk of shards ``i*n .. i*n+n-1``, and the
inter reduce-scatter hands node ``j`` the ``j``-th of those. Ownership is a permutation of the
flat one; the optimizer only needs `shard_index`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from mscale.dist.collectives import all_gather_into, reduce_scatter_into


class _Done:
    def wait(self) -> None:
        return None


class _FutureHandle:
    def __init__(self, fut: Future):
        self._fut = fut

    def wait(self) -> None:
        self._fut.result()


class LocalComm:
    """DP size 1: the reduced gradient is the local one."""

    size = 1
    shard_index = 0

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        if out is not None:
            out.copy_(buf)
        return _Done()

    def gather(self, full: torch.Tensor, shard: torch.Tensor):
        full.copy_(shard)
        return _Done()

    def close(self) -> None:
        pass


class FlatComm:
    """One ring (or tree) over the whole DP group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.shard_index = dist.get_rank(group)

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        if out is None:
            return dist.all_reduce(buf, group=self.group, async_op=True)
        return reduce_scatter_into(out, buf, self.group, async_op=True, scratch=True)

    def gather(self, full: torch.Tensor, shard: torch.Tensor):
        return all_gather_into(full, shard, self.group, async_op=True)

    def close(self) -> None:
        pass


class HierarchicalComm:
    """Node-local reduce-scatter, cross-node reduction of the chunk, node-local all-gather."""

    def __init__(self, intra: dist.ProcessGroup, inter: dist.ProcessGroup):
        self.intra, self.inter = intra, inter
        self.k, self.n = dist.get_world_size(intra), dist.get_world_size(inter)
        self.size = self.k * self.n
        self.shard_index = dist.get_rank(intra) * self.n + dist.get_rank(inter)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mscale-dp")

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        return _FutureHandle(self._pool.submit(self._reduce, buf, out))

    def gather(self, full: torch.Tensor, shard: torch.Tensor):
        return _FutureHandle(self._pool.submit(self._gather, full, shard))

    def _reduce(self, buf: torch.Tensor, out: torch.Tensor | None) -> None:
        chunk = buf.new_empty(buf.numel() // self.k)
        reduce_scatter_into(chunk, buf, self.intra, scratch=True)
        if out is None:
            dist.all_reduce(chunk, group=self.inter)
            all_gather_into(buf, chunk, self.intra)
        else:
            reduce_scatter_into(out, chunk, self.inter, scratch=True)

    def _gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        chunk = full.new_empty(full.numel() // self.k)
        all_gather_into(chunk, shard, self.inter)
        all_gather_into(full, chunk, self.intra)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_comm(groups, hierarchical: bool):
    """The strategy for this rank's DP group (``groups``: ParallelGroups, or None = one process)."""
    if groups is None or groups.dp_size == 1 or groups.dp_group is None:
        return LocalComm()
    intra, inter = groups.dp_intra_group, groups.dp_inter_group
    if hierarchical:
        if intra is None or inter is None:
            raise ValueError("hierarchical DP reduction needs build_groups(hierarchical_dp=True)")
        if dist.get_world_size(intra) > 1 and dist.get_world_size(inter) > 1:
            return HierarchicalComm(intra, inter)
    return FlatComm(groups.dp_group)
