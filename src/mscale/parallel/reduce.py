"""How one bucket is reduced over the DP group, and how updated shards are gathered back.

Three strategies with the same two calls, each returning a handle with ``wait()``:

- `LocalComm` (DP size 1): no communication; copies where a shard is expected.
- `FlatComm`: one asynchronous collective per bucket on the whole DP group (all-reduce for
  ZeRO 0, reduce-scatter for ZeRO 1/2; all-gather for the parameters).
- `HierarchicalComm`: reduce-scatter inside the node, then all-reduce (ZeRO 0) or reduce-scatter
  (ZeRO 1/2) of that chunk across nodes, then (ZeRO 0) all-gather inside the node. Each step
  needs the previous one's result, on another group.

Who issues the hierarchical chain, and why the order is the same on every rank:

- CUDA (NCCL): the thread that runs backward, with ``async_op`` handles, never a second host
  thread. A bucket's whole chain is issued at once on a side stream that first waits for the
  compute stream (the gradients are complete there); between two steps of the chain the side
  stream waits for the previous handle (``work.wait()`` blocks the *current stream*, not the
  host), and the caller's ``wait()`` makes the compute stream wait for the last one. So the host
  issues, in program order, bucket 0's three collectives, then bucket 1's, ...: one sequence,
  identical on every rank (buckets launch strictly in order, parallel/data.py). Each collective
  depends only on collectives issued before it in that sequence, so by induction each one can
  complete on every rank once the ones before it have: no cycle between the intra and inter
  communicators, whose streams each run their collectives in that issue order. A second host
  thread would interleave its collectives with the training thread's tensor- and
  pipeline-parallel ones in a timing-dependent order that differs between ranks; NCCL kernels of
  different communicators launched in different orders can deadlock the GPUs. Only one thread
  issues at a time here (autograd's device thread runs the backward hooks while the training
  thread waits inside ``backward()``).
- CPU (gloo): one worker thread runs each bucket's chain with blocking collectives, buckets in
  order. A gloo collective blocks the thread that waits for it, so on the training thread the
  chain would stall backward at every step of it; on the worker the chain overlaps backward
  (docs/benchmarks.md measures the difference). It is safe on gloo: the worker is the only thread
  that issues on the intra and inter groups, so each of them sees one order (bucket order, chain
  order), the same on every rank; gloo pairs a group's collectives by their per-group sequence
  number and runs each group on its own connections and host threads, so a collective of one
  group (the training thread's TP, PP or DP-norm ones) never waits for another group's.

Shard numbering under hierarchical ZeRO: with ``k`` DP ranks per node and ``n`` nodes, the rank
at intra position ``i`` on node ``j`` owns shard ``i*n + j`` of each bucket: the intra
reduce-scatter hands position ``i`` the contiguous chunk of shards ``i*n .. i*n+n-1``, and the
inter reduce-scatter hands node ``j`` the ``j``-th of those. Ownership is a permutation of the
flat one; the optimizer only needs `shard_index`.
"""

from __future__ import annotations

import threading
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


def issue_from_thread(device: torch.device) -> bool:
    """True where the hierarchical chain runs on a worker thread: CPU tensors (gloo). See the
    module docstring for why, and why CUDA tensors (NCCL) never do."""
    return device.type == "cpu"


class HierarchicalComm:
    """Node-local reduce-scatter, cross-node reduction of the chunk, node-local all-gather."""

    def __init__(self, intra: dist.ProcessGroup, inter: dist.ProcessGroup, device: torch.device):
        self.intra, self.inter = intra, inter
        self.k, self.n = dist.get_world_size(intra), dist.get_world_size(inter)
        self.size = self.k * self.n
        self.shard_index = dist.get_rank(intra) * self.n + dist.get_rank(inter)
        self.device = device
        threaded = issue_from_thread(device)
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="mscale-dp")
                      if threaded else None)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.issued: list[tuple[str, str, int]] | None = None
        """Set to a list to record (group, collective, issuing thread) in issue order: the
        order that must be the same on every rank (tests compare it)."""

    def reduce(self, buf: torch.Tensor, out: torch.Tensor | None):
        return self._issue(self._reduce, buf, out)

    def gather(self, full: torch.Tensor, shard: torch.Tensor):
        return self._issue(self._gather, full, shard)

    def _issue(self, chain, *tensors: torch.Tensor):
        """Run ``chain`` on the worker thread (gloo) or issue it here (see the module docstring);
        ``chain`` returns (the last collective's handle, temporaries to keep until it is done)."""
        if self._pool is not None:
            return _FutureHandle(self._pool.submit(lambda: chain(*tensors)[0].wait()))
        if self._side is None:  # the CUDA path's order on CPU tensors (tests): waits block
            work, _ = chain(*tensors)
            return work
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            work, keep = chain(*tensors)
        return _StreamHandle(work, keep + list(tensors))

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
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def make_comm(groups, hierarchical: bool, device: torch.device | None = None):
    """The strategy for this rank's DP group (``groups``: ParallelGroups, or None = one process;
    ``device``: where the buckets live, which decides who issues a hierarchical chain)."""
    if groups is None or groups.dp_size == 1 or groups.dp_group is None:
        return LocalComm()
    intra, inter = groups.dp_intra_group, groups.dp_inter_group
    if hierarchical:
        if intra is None or inter is None:
            raise ValueError("hierarchical DP reduction needs build_groups(hierarchical_dp=True)")
        if dist.get_world_size(intra) > 1 and dist.get_world_size(inter) > 1:
            return HierarchicalComm(intra, inter, device or torch.device("cpu"))
    return FlatComm(groups.dp_group)
