"""Stage 1 of a save: copy this rank's slices into host memory, overlapped with the next step.

Nothing changes the parameters or the optimizer state between one optimizer step and the next
one's update: the forward and backward passes only read them. So the copy runs on the writer
thread while the next step's forward/backward runs, and training blocks only at that step's
update, and only if the copy has not finished by then (`CopyGate`; CheckFreq, FAST'21, pipelines
its snapshot the same way). A save that must be complete before training moves on (halt, the
last step) waits for the whole write anyway.

All slices go into one host arena, allocated at the first save and reused by every later one
(the paper keeps pinned host buffers for the same reason: allocating and faulting in fresh pages
costs as much as the copy itself). On a CPU the copies are memcpys that release the GIL. On a GPU
the arena is pinned and the copies are asynchronous, which needs three things to be right:

- the writer thread is a new host thread, whose current CUDA device is GPU 0 whatever the
  training thread chose: `save` captures the rank's device and the thread sets it
  (`use_device`) before creating anything, or every rank with local rank != 0 would open a
  context on GPU 0 and put its copy stream there;
- the copies run on a side stream of that device which first waits for an event recorded on the
  training stream after the update that produced the values (`ready_event`);
- a non-blocking device-to-host copy returns before the bytes are in host memory: an event
  recorded on the side stream after the last copy is synchronised before the snapshot is handed
  on, so the write (and its crc32) never reads pinned memory that is still being filled.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from mscale.ckpt.format import torch_dtype
from mscale.ckpt.manifest import itemsize
from mscale.ckpt.ownership import Item

ALIGN = 64


@dataclass
class Snapshot:
    """Host copies of the items, in order, and the seconds the copy blocked."""

    items: list[Item]
    views: Iterable[torch.Tensor]
    """Per item a 1-D uint8 view of its bytes in the arena; the writer reads them once, in order,
    so an offline convert passes a generator and holds one slice at a time."""
    seconds: float
    nbytes: int


class HostArena:
    """One reusable host buffer for a fixed list of slices."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _ensure(self, size: int, pin: bool) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < size or self._pinned != pin:
            self._buf = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=pin)
            self._pinned = pin
        return self._buf

    def take(self, items: list[Item], sources: list[torch.Tensor], after=None,
             device: torch.device | None = None) -> Snapshot:
        """Copy ``sources[i]`` (1-D, ``items[i].count`` elements of ``items[i].dtype``) into the
        arena. GPU sources (on ``device``, the rank's GPU) are copied on a side stream of that
        device that first waits for ``after`` (a CUDA event recorded where the values were final);
        returns only once the bytes are in host memory."""
        t0 = time.perf_counter()
        offsets, size = [], 0
        for it in items:
            offsets.append(size)
            size += -(-it.count * itemsize(it.dtype) // ALIGN) * ALIGN
        cuda = any(s.is_cuda for s in sources)
        buf = self._ensure(size, pin=cuda)
        views = []
        for it, off in zip(items, offsets):
            views.append(buf[off: off + it.count * itemsize(it.dtype)])
        if cuda:
            self._copy_cuda(views, items, sources, after, _cuda_device(sources, device))
        else:
            for it, src, view in zip(items, sources, views):
                if view.numel():
                    view.view(torch_dtype(it.dtype)).copy_(src.detach().reshape(-1))
        nbytes = sum(v.numel() for v in views)
        return Snapshot(items, views, time.perf_counter() - t0, nbytes)

    def _copy_cuda(self, views, items, sources, after, device: torch.device) -> None:
        """Non-blocking copies on this device's side stream, ordered after ``after``; waits for
        an event recorded after the last one (see the module docstring)."""
        with torch.cuda.device(device):
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            if after is not None:
                stream.wait_event(after)
            with torch.cuda.stream(stream):
                for it, src, view in zip(items, sources, views):
                    if view.numel():
                        view.view(torch_dtype(it.dtype)).copy_(src.detach().reshape(-1),
                                                          non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            copied.synchronize()


def _cuda_device(sources: list[torch.Tensor], device: torch.device | None) -> torch.device:
    """The GPU the copies run on: the rank's device, which every GPU source must be on."""
    on = {s.device for s in sources if s.is_cuda}
    device = device if device is not None and device.type == "cuda" else next(iter(on))
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if any(d != device for d in on):
        raise ValueError(f"snapshot sources on {sorted(map(str, on))}, expected {device}")
    return device


def use_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op off CUDA). Each host
    thread has its own current device, GPU 0 until set."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


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
    """A CUDA event on the training thread's current stream of the sources' device (the values
    are final there), or None on CPUs."""
    device = next((s.device for s in sources if s.is_cuda), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


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
