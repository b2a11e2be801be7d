"""How one bucket is reduced over the DP group, and how updated shards are gathered back.

Three strategies with the same two calls, each returning a handle with ``wait()``:

- `LocalComm` (DP size 1): no communication; copies where a shard is expected.
- `FlatComm`: one asynchronous collective per bucket on the whole DP group (all-reduce for
  ZeRO 0, reduce-scatter for ZeRO 1/2; all-gather for the parameters).
- `HierarchicalComm`: reduce-scatter inside the node, then all-reduce (ZeRO 0) or reduce-scatter
  (ZeRO 1/2) of that chunk across nodes, then (ZeRO 0) all-gather inside the node. Each step
  needs the previous one's result, on another group.

Who issues the hierarchical chain, and why the order is the same on every rank: the thread that
runs backward (the training thread; on CUDA, autograd's device thread while the training thread
waits inside ``backward()``), with ``async_op`` handles, never a second host thread. So the host
issues, in program order, bucket 0's collectives, then bucket 1's, ...: one sequence, identical on
every rank (buckets launch strictly in order, parallel/data.py; the tensor- and pipeline-parallel
collectives around them come in the same program order too). Each collective depends only on
collectives issued before it in that sequence, so by induction each one can complete on every
rank once the ones before it have: no cycle between the intra and inter communicators. A second
host thread would interleave its collectives with the training thread's in a timing-dependent
order that differs between ranks; NCCL kernels of different communicators launched in different
orders can deadlock the GPUs.

- CUDA: a bucket's whole chain is issued at once on a side stream that first waits for the
  compute stream (the gradients are complete there); between two steps the side stream waits for
  the previous handle (``work.wait()`` blocks the *current stream*, not the host), and the
  caller's ``wait()`` makes the compute stream wait for the last one. The host never blocks, and
  the chain overlaps the rest of backward.
- CPU (gloo): a gloo wait blocks the thread, so the chain's intermediate waits run inside the
  backward hook that launches the bucket. Against the former worker thread (which ran each chain
  with blocking collectives, beside backward) this cost nothing measurable on two cores:
  4 ranks, ZeRO-1, 4.2 M parameters, step 147-154 ms against 151-155 ms (docs/benchmarks.md).

Shard numbering under hierarchical ZeRO: with ``k`` DP ranks per node and ``n`` nodes, the rank
at intra position ``i`` on node ``j`` owns shard ``i*n + j`` of each bucket: the intra
reduce-scatter hands position ``i`` the contiguous chunk of shards ``i*n .. i*n+n-1``, and the
inter reduce-scatter hands node ``j`` the ``j``-th of those. Ownership is a permutation of the
flat one; the optimizer only needs `shard_index`.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from mscale.distributed.collectives import all_gather_into, reduce_scatter_into
from mscale.parallel.shard_layout import hierarchical_shard


class _Done:
    def wait(self) -> None:
        return None


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


class _StreamHandle:
    """The last collective of a chain issued on a side stream. ``wait()`` makes the caller's
    current stream wait for it; the chain's temporaries are then marked as used by that stream,
    so the caching allocator cannot hand their memory out before the stream has passed here."""

    def __init__(self, work, keep: list[torch.Tensor]):
        self.work, self.keep = work, keep

    def wait(self) -> None:
        self.work.wait()
        for t in self.keep:
            t.record_stream(torch.cuda.current_stream(t.device))
        self.keep = []


class HierarchicalComm:
    """Node-local reduce-scatter, cross-node reduction of the chunk, node-local all-gather."""

    def __init__(self, intra: dist.ProcessGroup, inter: dist.ProcessGroup, device: torch.device):
        self.intra, self.inter = intra, inter
        self.k, self.n = dist.get_world_size(intra), dist.get_world_size(inter)
        self.size = self.k * self.n
        self.shard_index = hierarchical_shard(dist.get_rank(intra), dist.get_rank(inter), self.n)
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.issued: list[tuple[str, str, int]] | None = None
        """Set to a list to record (group, collective, issuing thread) in issue order: the
        order that must be the same on every rank (tests compare it)."""

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        return self._issue(self._reduce, buf, out)

    def gather(self, full: torch.Tensor, shard: torch.Tensor):
        return self._issue(self._gather, full, shard)

    def _issue(self, chain, *tensors: torch.Tensor):
        """Issue ``chain`` from this thread (see the module docstring); it returns the last
        collective's handle and the temporaries to keep until that one is done."""
        if self._side is None:  # CPU: the intermediate waits have blocked; the last is pending
            return chain(*tensors)[0]
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            work, keep = chain(*tensors)
        return _StreamHandle(work, keep + [t for t in tensors if t is not None])

    def _note(self, group: str, op: str) -> None:
        if self.issued is not None:
            self.issued.append((group, op, threading.get_ident()))

    def _reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        chunk = buf.new_empty(buf.numel() // self.k)
        self._note("intra", "reduce_scatter")
        reduce_scatter_into(chunk, buf, self.intra, async_op=True, scratch=True).wait()
        if out is None:
            self._note("inter", "all_reduce")
            dist.all_reduce(chunk, group=self.inter, async_op=True).wait()
            self._note("intra", "all_gather")
            return all_gather_into(buf, chunk, self.intra, async_op=True), [chunk]
        self._note("inter", "reduce_scatter")
        return reduce_scatter_into(out, chunk, self.inter, async_op=True, scratch=True), [chunk]

    def _gather(self, full: torch.Tensor, shard: torch.Tensor):
        chunk = full.new_empty(full.numel() // self.k)
        self._note("inter", "all_gather")
        all_gather_into(chunk, shard, self.inter, async_op=True).wait()
        self._note("intra", "all_gather")
        return all_gather_into(full, chunk, self.intra, async_op=True), [chunk]

    def close(self) -> None:
        pass


def make_comm(groups, hierarchical: bool, device: torch.device | None = None):
    """The strategy for this rank's DP group (``groups``: ParallelGroups, or None = one process;
    ``device``: where the buckets live; on CUDA a hierarchical chain runs on a side stream)."""
    if groups is None or groups.dp_size == 1 or groups.dp_group is None:
        return LocalComm()
    intra, inter = groups.dp_intra_group, groups.dp_inter_group
    if hierarchical:
        if intra is None or inter is None:
            raise ValueError("hierarchical DP reduction needs build_groups(hierarchical_dp=True)")
        if dist.get_world_size(intra) > 1 and dist.get_world_size(inter) > 1:
            return HierarchicalComm(intra, inter, device or torch.device("cpu"))
    return FlatComm(groups.dp_group)
