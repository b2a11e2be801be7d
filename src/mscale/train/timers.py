"""Per-rank step timing, split into compute, communication wait, data loading and bubble.

Without this split no straggler can be found: in synchronous training every rank's step time
equals the slowest rank's, and the culprit is the rank with the highest compute time and the
lowest communication wait (docs/references.md). Tensor-parallel collectives, which run inside
forward and backward, are counted by `mscale.distributed.collectives.COMM_CLOCK`.

Regions are pairs of marks resolved at the step's end. On CPUs a mark is a monotonic clock
reading, exact because every call is synchronous. On GPUs a mark is a CUDA event on the current
stream: a region then measures how long the *compute stream* spent on it (waiting for a
collective, a batch copy, or for the host to queue the next kernel), and the host never waits
inside a step, so it keeps queuing ahead of the device. The step's one synchronize is in
`end_step`, where the events are read. Work the host queued while the device was still busy
costs the stream nothing, so a region whose work was hidden reads near zero: the exposed time,
which is what the straggler rule needs.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from mscale.distributed.collectives import COMM_CLOCK, LINKS, HostClock, clock_for

REGIONS = ("step", "compute", "comm_wait", "data", "bubble")
BY_LINK = tuple(f"comm_{kind}" for kind in LINKS)
"""Communication seconds per kind of traffic (``comm_tp``, ``comm_pp``, ``comm_dp``): the same
waits as ``comm_wait`` and the bubble's receives, told apart by the group they waited on."""


class StepTimer:
    """Accumulates seconds per region for the current step.

    ``clock``: where marks come from; by default CUDA events on a CUDA ``device`` and the
    monotonic clock elsewhere. Tests pass a `HostClock` over a fake ``now``.
    """

    def __init__(self, device: torch.device | None = None, clock=None):
        self.device = device or torch.device("cpu")
        self.clock = clock or clock_for(self.device)
        self._added = dict.fromkeys(REGIONS, 0.0)
        self._spans: list[tuple] = []
        self._start = None
        self.tracing = False
        """This step records a timeline (train/trace.py): each forward, backward and wait."""
        self._work: list[tuple] = []
        self.events: list[tuple[str, int, int, float, float]] | None = None
        """The last traced step's events: (name, micro-batch, chunk, start s, end s), seconds
        from the step's start; None when the last step was not traced."""

    def start_step(self, trace: bool = False) -> None:
        self._added = dict.fromkeys(REGIONS, 0.0)
        self._spans, self._work, self.tracing = [], [], trace
        # the collective clock follows this timer; what collectives between steps (metrics,
        # control) counted is dropped
        COMM_CLOCK.use(self.clock)
        self._start = self.clock.mark()

    def work(self, name: str, micro: int, chunk: int = 0):
        """A forward or backward of one micro-batch (and model chunk), for the timeline; a
        no-op context unless this step is traced, so untraced steps pay one attribute read."""
        return self._work_span(name, micro, chunk) if self.tracing else _UNTRACED

    @contextmanager
    def _work_span(self, name: str, micro: int, chunk: int):
        m0 = self.clock.mark()
        try:
            yield
        finally:
            self._work.append((name, micro, chunk, m0, self.clock.mark()))

    @contextmanager
    def region(self, name: str, link: str | None = None):
        """Time a block as ``comm_wait``, ``data`` or ``bubble``; compute is the remainder.
        ``link``: the kind of traffic the block waits on (one of `LINKS`), also counted in
        ``comm_<link>``.

        Time the block spent inside collectives timed by COMM_CLOCK (e.g. the broadcast of a
        batch to TP peers inside ``data``) is left out here, since the clock hands it to
        ``comm_wait`` at the end of the step: every second is counted once.
        """
        p0, m0 = COMM_CLOCK.position(), self.clock.mark()
        try:
            yield
        finally:
            self._spans.append((name, link, m0, self.clock.mark(), p0, COMM_CLOCK.position()))

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere, in host seconds."""
        self._added[name] += seconds

    def end_step(self) -> dict[str, float]:
        end = self.clock.mark()
        self.clock.settle(end)  # GPU: the step's one synchronize
        t = dict(self._added) | dict.fromkeys(BY_LINK, 0.0)
        for name, link, m0, m1, p0, p1 in self._spans:
            seconds = self.clock.seconds(m0, m1) - COMM_CLOCK.between(p0, p1)
            t[name] += seconds
            if link is not None:
                t[f"comm_{link}"] += seconds
        t["step"] = self.clock.seconds(self._start, end)
        inside, by_kind = COMM_CLOCK.take()  # collectives inside forward/backward and regions
        t["comm_wait"] += inside
        for kind, seconds in by_kind.items():
            t[f"comm_{kind}"] += seconds
        self.events = self._timeline() if self.tracing else None
        t["compute"] = max(0.0, t["step"] - t["comm_wait"] - t["data"] - t["bubble"])
        self._spans, self._work = [], []
        COMM_CLOCK.use(HostClock())  # between steps collectives are not attributed
        self.clock.recycle()
        return t

    def _timeline(self) -> list[tuple[str, int, int, float, float]]:
        """The traced step's work and waits, seconds from its start (marks are settled)."""
        at = lambda m: self.clock.seconds(self._start, m)  # noqa: E731
        out = [(name, micro, chunk, at(a), at(b)) for name, micro, chunk, a, b in self._work]
        for name, link, a, b, _, _ in self._spans:
            label = f"{link} wait" if link and name == "comm_wait" else name
            out.append((label, -1, -1, at(a), at(b)))
        return sorted(out, key=lambda e: e[3])


_UNTRACED = nullcontext()
