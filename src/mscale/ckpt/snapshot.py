"""Stage 1 of a save: copy this rank's slices into host memory, overlapped with the next step.

Nothing changes the parameters or the optimizer state between one optimizer step and the next
one's update: the forward and backward passes only read them. So the copy runs on the writer
thread while the next step's forward/backward runs, and training blocks only at that step's
update, and only if the copy has not finished by then (`CopyGate`; CheckFreq, FAST'21, pipelines
its snapshot the same way). A save that must be complete before training moves on (halt, the
last step) waits for the whole write anyway.

All slices go into one host arena, allocated at the first save and reused by every later one
(the paper keeps pinned host buffers for the same reason: allocating and faulting in fresh pages
costs as much as the copy itself). On a GPU the arena is pinned and the copies run on a side
stream ordered after the optimizer step that produced the values; on a CPU they are memcpys that
release the GIL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from mscale.ckpt.format import itemsize
from mscale.ckpt.manifest import DTYPES
from mscale.ckpt.ownership import Item

ALIGN = 64


@dataclass
class Snapshot:
    """Host copies of the items, in order, and the seconds the copy blocked."""

    items: list[Item]
    views: list[torch.Tensor]
    """Per item a 1-D uint8 view of its bytes in the arena."""
    seconds: float
    nbytes: int


class HostArena:
    """One reusable host buffer for a fixed list of slices."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False

    def _ensure(self, size: int, pin: bool) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < size or self._pinned != pin:
            self._buf = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pin)
            self._pinned = pin
        return self._buf

    def take(self, items: list[Item], sources: list[torch.Tensor], after=None) -> Snapshot:
        """Copy ``sources[i]`` (1-D, ``items[i].count`` elements of ``items[i].dtype``) into the
        arena. GPU sources are copied on a side stream that first waits for ``after`` (a CUDA
        event recorded where the values were final)."""
        t0 = time.perf_counter()
        offsets, size = [], 0
        for it in items:
            offsets.append(size)
            size += -(-it.count * itemsize(it.dtype) // ALIGN) * ALIGN
        cuda = any(s.is_cuda for s in sources)
        buf = self._ensure(size, pin=cuda)
        views = []
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None and after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream) if cuda else _nothing():
            for it, src, off in zip(items, sources, offsets):
                n = it.count * itemsize(it.dtype)
                view = buf[off: off + n]
                if n:
                    view.view(DTYPES[it.dtype]).copy_(src.detach().reshape(-1), non_blocking=cuda)
                views.append(view)
        if stream is not None:
            stream.synchronize()
        nbytes = sum(v.numel() for v in views)
        return Snapshot(items, views, time.perf_counter() - t0, nbytes)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


class CopyGate:
    """Set when a snapshot's host copy is done; `wait` blocks the optimizer step until then."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.waited_s = 0.0

    def open(self) -> None:
        self._done.set()

    def wait(self) -> None:
        if not self._done.is_set():
            t0 = time.perf_counter()
            self._done.wait()
            self.waited_s += time.perf_counter() - t0


def ready_event(sources: list[torch.Tensor]):
    """A CUDA event on the current stream (the values are final there), or None on CPUs."""
    if any(s.is_cuda for s in sources):
        event = torch.cuda.Event()
        event.record()
        return event
    return None


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's generator states as uint8 tensors: CPU, and the current GPU's if any."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    if "cpu" in states:
        torch.set_rng_state(states["cpu"].clone())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].clone(), device)
