"""Stage 1 of a save: copy this rank's slices into host memory. The only part that blocks training.

All slices go into one host arena, allocated at the first save and reused by every later one
(the paper keeps pinned host buffers for the same reason: allocating and faulting in fresh pages
costs as much as the copy itself). On a GPU the arena is pinned and the copies are asynchronous,
with one synchronisation at the end; on a CPU they are plain memcpys. Once `take` returns,
training may change every parameter: the writer only reads the arena.
"""

from __future__ import annotations

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

    def take(self, items: list[Item], sources: list[torch.Tensor]) -> Snapshot:
        """Copy ``sources[i]`` (1-D, ``items[i].count`` elements of ``items[i].dtype``) into the
        arena. ``sources`` may live on a GPU."""
        t0 = time.perf_counter()
        offsets, size = [], 0
        for it in items:
            offsets.append(size)
            size += -(-it.count * itemsize(it.dtype) // ALIGN) * ALIGN
        cuda = any(s.is_cuda for s in sources)
        buf = self._ensure(size, pin=cuda)
        views = []
        for it, src, off in zip(items, sources, offsets):
            n = it.count * itemsize(it.dtype)
            view = buf[off: off + n]
            if n:
                view.view(DTYPES[it.dtype]).copy_(src.detach().reshape(-1), non_blocking=cuda)
            views.append(view)
        if cuda:
            torch.cuda.current_stream().synchronize()
        nbytes = sum(v.numel() for v in views)
        return Snapshot(items, views, time.perf_counter() - t0, nbytes)


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
