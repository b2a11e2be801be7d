"""Small wrappers over torch.distributed collectives that differ between torch versions."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor variants (the old names still work but warn on every call).
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None)
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False):
    """Concatenate every member's ``inp`` along dim 0 into ``out``."""
    if _ALL_GATHER_SINGLE is not None:
        return _ALL_GATHER_SINGLE(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


class _SliceAfterAllReduce:
    """A pending all-reduce that, once waited for, copies this member's chunk into ``out``."""

    def __init__(self, work, out: torch.Tensor, chunk: torch.Tensor):
        self.work, self.out, self.chunk = work, out, chunk

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - same signature as dist.Work.wait
        self.work.wait()
        self.out.copy_(self.chunk)
        return True


def _is_gloo(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # pragma: no cover - uninitialised
        return False
    return tensor.device.type == "cpu" and "gloo" in str(backend)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                        async_op: bool = False, scratch: bool = False):
    """Sum ``inp`` over members and give member i the i-th chunk (dim 0) in ``out``.

    On gloo this is an all-reduce followed by a copy of the own chunk: gloo's reduce-scatter was
    measured slower than its full all-reduce of the same tensor (32 MB: 40 ms against 28.5 ms on
    2 ranks, 76 against 55 ms on 4; docs/benchmarks.md). ``scratch=True`` lets it all-reduce
    ``inp`` in place (the caller never reads it again, e.g. a DP bucket); otherwise a copy is
    reduced, since autograd may share a gradient tensor between consumers.
    """
    if _is_gloo(inp, group):
        buf = inp if scratch else inp.clone()
        size = dist.get_world_size(group)
        chunk = buf.view(size, -1)[dist.get_rank(group)].view_as(out)
        work = dist.all_reduce(buf, group=group, async_op=async_op)
        if async_op:
            return _SliceAfterAllReduce(work, out, chunk)
        out.copy_(chunk)
        return None
    if _REDUCE_SCATTER_SINGLE is not None:
        return _REDUCE_SCATTER_SINGLE(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


class CommClock:
    """Seconds the training thread spent inside blocking collectives since the last `take`.

    Tensor-parallel collectives sit in the middle of forward and backward, so no region timer
    around the step can see them; their call sites wrap themselves in `timed()`. The step timer
    moves the total into ``comm_wait`` at the end of each step. Without this, the TP peer of a slow
    rank would look busy (its wait hidden inside "compute") and the straggler rule (highest compute,
    lowest wait) would point at the wrong rank. On GPUs NCCL calls return once enqueued, so this
    clock measures launch time only; there the engine's region timers carry the signal.
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Return the accumulated seconds and start again from zero."""
        s, self.seconds = self.seconds, 0.0
        return s


COMM_CLOCK = CommClock()
"""The process-wide clock of blocking collectives (one training thread per process)."""
