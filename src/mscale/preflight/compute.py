"""Matrix-multiply throughput of this rank's device: bf16 on a GPU, fp32 on a CPU.

Every iteration starts after a barrier, so on machines where ranks share cores (``--local`` on
CPUs) each iteration runs under the same contention; the rank's figure is its best iteration (a
device's capability: a slow device is slow in every iteration, a descheduled one only in some).
The ``--inject-slow RANK:FACTOR`` hook sleeps (FACTOR − 1) × each timed operation's fastest time
on that rank, inside the timed region: its work runs at 1/FACTOR speed, in wall time, as its
peers see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

SIZES = {("cpu", "quick"): 384, ("cpu", "full"): 768, ("cuda", "quick"): 4096,
         ("cuda", "full"): 8192}
ITERS = {"quick": 8, "full": 20}


@dataclass
class Slowdown:
    """The test hook: how much slower this rank's timed operations run (1.0: not slowed).

    The added sleep is (factor − 1) × the fastest time seen so far for the same operation, not
    × the time just measured: that time includes waiting for a peer, and when two slowed ranks
    wait for each other, sleeping in proportion to it would grow geometrically (3^iterations
    at factor 4) instead of slowing the rank by a constant factor."""

    factor: float = 1.0
    _best: dict = field(default_factory=dict)

    def after(self, t0: float, op: str = "", alone: bool = False) -> None:
        """Sleep so that the operation ``op`` started at ``t0`` takes ``factor`` times as long.
        ``alone``: the operation waits for no peer (a GEMM after the barrier), so its own time is
        the one to scale. Scaling the fastest one ever seen instead would weaken the slowdown
        whenever one sample ran on an idle core (8 ranks on 2 cores): a 4x device then measured
        at 0.6 of its peers once in a while, and the slowed rank's GEMM passed."""
        if self.factor > 1.0:
            took = time.perf_counter() - t0
            best = self._best[op] = min(self._best.get(op, took), took)
            time.sleep((self.factor - 1.0) * (took if alone else best))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(device: torch.device, level: str, slow: Slowdown) -> tuple[float, int, str]:
    """Best TFLOP/s over the level's iterations; returns (tflops, n, dtype name)."""
    n = SIZES[(device.type if device.type == "cuda" else "cpu", level)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: allocation, kernel selection
    sync(device)
    best = float("inf")
    for _ in range(ITERS[level]):
        dist.barrier()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        slow.after(t0, "gemm", alone=True)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12, n, str(dtype).removeprefix("torch.")
