"""Per-rank step timing, split into compute, communication wait and data loading.

Without this split no straggler can be found: in synchronous training every rank's step time
equals the slowest rank's, and the culprit is the rank with the highest compute time and the
lowest communication wait (docs/references.md). Tensor-parallel collectives, which run inside forward and
backward, are counted by `mscale.dist.collectives.COMM_CLOCK`. On CPUs a monotonic clock is exact
because every call is synchronous; on GPUs the regions are closed with a device synchronize at
the region boundary (CUDA events would avoid the sync but make attribution of overlapped kernels
ambiguous; the boundaries here are the few points where the loop waits anyway).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mscale.dist.collectives import COMM_CLOCK

REGIONS = ("step", "compute", "comm_wait", "data", "bubble")


@dataclass
class StepTimer:
    """Accumulates seconds per region for the current step."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(REGIONS, 0.0))
    _step_start: float = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self.totals = dict.fromkeys(REGIONS, 0.0)
        self._sync()
        COMM_CLOCK.take()  # drop what collectives between steps (metrics, control) accumulated
        self._step_start = time.perf_counter()

    @contextmanager
    def region(self, name: str):
        """Time a block as ``comm_wait``, ``data`` or ``bubble``; compute is the remainder.

        Time the block spent inside collectives timed by COMM_CLOCK (e.g. the broadcast of a
        batch to TP peers inside ``data``) is left out here, since the clock hands it to
        ``comm_wait`` at the end of the step: every second is counted once.
        """
        self._sync()
        t0, inner0 = time.perf_counter(), COMM_CLOCK.seconds
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - t0
            self.totals[name] += elapsed - (COMM_CLOCK.seconds - inner0)

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. the DP wait the gradient buffer reports)."""
        self.totals[name] += seconds

    def end_step(self) -> dict[str, float]:
        self._sync()
        t = self.totals
        t["step"] = time.perf_counter() - self._step_start
        t["comm_wait"] += COMM_CLOCK.take()  # tensor-parallel collectives inside forward/backward
        t["compute"] = max(0.0, t["step"] - t["comm_wait"] - t["data"] - t["bubble"])
        return dict(t)
