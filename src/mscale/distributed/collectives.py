"""Small wrappers over torch.distributed collectives that differ between torch versions."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

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


class HostClock:
    """Marks from a monotonic clock (``now``, injectable so tests need no real sleeps). Exact on
    CPUs, where every call is synchronous: a region's end mark is taken when its work is done."""

    immediate = True

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now

    def mark(self) -> float:
        return self.now()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def settle(self, last: float) -> None:  # noqa: ARG002 - same calls as CudaClock
        """Nothing to wait for: host marks are final when taken."""

    def recycle(self) -> None:
        """Nothing to recycle."""


class CudaClock:
    """Marks are CUDA events recorded on the current stream of ``device``.

    A mark is the moment the stream *reaches* it, so the seconds between two marks are how long
    the compute stream spent on what was queued between them: a wait for a collective, a data
    copy, or nothing at all when the host queued that work while the device was still busy.
    Reading needs the events complete; the step timer waits once, at the step's end (`settle`),
    instead of synchronizing around every region, which would stop the CPU queuing ahead.
    Events come from a pool reused after each `recycle` (creating ~2 per collective per step
    would cost more than recording them)."""

    immediate = False

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list = []
        self._used: list = []

    def mark(self):
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._used.append(ev)
        return ev

    def seconds(self, a, b) -> float:
        try:
            return a.elapsed_time(b) / 1e3
        except RuntimeError:  # a mark recorded on another stream than the settled one
            a.synchronize()
            b.synchronize()
            return a.elapsed_time(b) / 1e3

    def settle(self, last) -> None:
        """The step's one synchronize: every mark on this stream before ``last`` is then final."""
        last.synchronize()

    def recycle(self) -> None:
        """Every mark handed out so far is resolved: their events may be recorded again."""
        self._free.extend(self._used)
        self._used.clear()


def clock_for(device: torch.device | None) -> HostClock | CudaClock:
    """CUDA events on a CUDA device, the monotonic clock elsewhere."""
    if device is not None and device.type == "cuda":
        return CudaClock(device)
    return HostClock()


LINKS = ("tp", "pp", "dp")
"""The kinds of traffic a step's communication time is split into: tensor-parallel collectives,
pipeline sends and receives, data-parallel reduction and parameter gathers. Groups of one kind
are peers of each other (every TP group runs the same collectives on the same bytes), which is
what lets watch tell a slow link from a job-wide slowdown (watch/detect/links.py)."""


class CommClock:
    """Time the training thread spent inside blocking collectives since the last `take`, in
    total and per kind of traffic (`LINKS`).

    Tensor-parallel collectives sit in the middle of forward and backward, so no region timer
    around the step can see them; their call sites wrap themselves in `timed(kind)`. The step
    timer moves the total into ``comm_wait`` at the end of each step. Without this, the TP peer of
    a slow rank would look busy (its wait hidden inside "compute") and the straggler rule (highest
    compute, lowest wait) would point at the wrong rank.

    The step timer installs its clock (`use`). On CPUs (`HostClock`) each span is added up at
    once into `seconds`. On GPUs NCCL calls return once enqueued, so host time would measure the
    launch only; there (`CudaClock`) a span is a pair of events around the call on the current
    stream, which the stream reaches before the collective starts and after it (or the stream's
    wait for it) ends: how long the compute stream waited. Those spans are kept until the step
    timer resolves them at the step's end.
    """

    def __init__(self) -> None:
        self.clock: HostClock | CudaClock = HostClock()
        self.seconds = 0.0
        """Resolved seconds (host clock)."""
        self.spans: list[tuple] = []
        """Event pairs (and their kind) not resolved yet (device clock)."""
        self.by_kind = dict.fromkeys(LINKS, 0.0)
        """Resolved seconds per kind of traffic (host clock)."""

    def use(self, clock) -> None:
        """Time with ``clock`` from now on, forgetting everything counted so far."""
        self.clock, self.seconds, self.spans = clock, 0.0, []
        self.by_kind = dict.fromkeys(LINKS, 0.0)

    @contextmanager
    def timed(self, kind: str):
        """Count the block as communication of ``kind`` (one of `LINKS`)."""
        clock = self.clock
        a = clock.mark()
        try:
            yield
        finally:
            b = clock.mark()
            if clock.immediate:
                dt = clock.seconds(a, b)
                self.seconds += dt
                self.by_kind[kind] += dt
            else:
                self.spans.append((a, b, kind))

    def position(self) -> tuple[float, int]:
        """Where the count stands; `between` two positions is the collective time in between."""
        return self.seconds, len(self.spans)

    def between(self, p0: tuple[float, int], p1: tuple[float, int]) -> float:
        """Seconds counted from ``p0`` to ``p1`` (device spans must be settled: see CudaClock)."""
        return p1[0] - p0[0] + sum(self.clock.seconds(a, b) for a, b, _ in self.spans[p0[1]:p1[1]])

    def take(self) -> tuple[float, dict[str, float]]:
        """The accumulated seconds, in total and per kind; start again from zero."""
        kinds = dict(self.by_kind)
        for a, b, kind in self.spans:
            kinds[kind] += self.clock.seconds(a, b)
        total = self.between((0.0, 0), self.position())
        self.seconds, self.spans, self.by_kind = 0.0, [], dict.fromkeys(LINKS, 0.0)
        return total, kinds


COMM_CLOCK = CommClock()
"""The process-wide clock of blocking collectives (one training thread per process)."""
