"""Per-rank step timing, split into compute, communication wait and data loading.

Without this split no straggler can be found: in synchronous training every rank's step time
equals the slowest rank's, and the culprit is the rank with the highest compute time and the
lowest communication wait (facts.md). On CPUs a monotonic clock is exact because every call is
synchronous; on GPUs the regions are closed with a device synchronize at the region boundary
(CUDA events would avoid the sync but make attribution of overlapped kernels ambiguous; the
boundaries here are the few points where the loop waits anyway).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

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
        self._step_start = time.perf_counter()

    @contextmanager
    def region(self, name: str):
        """Time a block as ``comm_wait``, ``data`` or ``bubble``; compute is the remainder."""
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. the DP wait the gradient buffer reports)."""
        self.totals[name] += seconds

    def end_step(self) -> dict[str, float]:
        self._sync()
        t = self.totals
        t["step"] = time.perf_counter() - self._step_start
        t["compute"] = max(0.0, t["step"] - t["comm_wait"] - t["data"] - t["bubble"])
        return dict(t)
