"""Held-out loss: the same fixed batches of held-out data, through the same 3D-parallel forward.

Every evaluation reads eval batches 0 .. ``eval.batches``-1 of the held-out split (docs/data.md),
so successive values are comparable and do not depend on the step. Each rank runs forward only
(no gradients, no activation kept) over its micro-batches of each batch, exactly as a training
step lays them out; the ranks that compute a loss (last pipeline stage, TP rank 0) contribute
their sums to one all-reduce, so every rank ends with the same mean, which is the mean over the
held-out sequences (every micro-batch has the same number of tokens).

A stop signal (Ctrl-C, SIGTERM, ...) takes effect between eval batches: 400 of them can take
half a minute, and an operator's Ctrl-C waited for all. Every rank asks, after each batch, the
same question the step boundary asks (`Control.stop_signalled`, one MAX all-reduce of a flag),
so all leave the evaluation after the same batch; the loop then stops at its step boundary. An
evaluation left early gives no loss: the mean of its first batches is not the held-out loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from mscale.distributed.init import to_device
from mscale.train.data import DataLoader

if TYPE_CHECKING:  # the engine imports nothing from here; only the type is named
    from mscale.train.engine import Engine


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean held-out loss (nats per token)."""
    seconds: float
    """Wall time of the evaluation on this rank, the all-reduce included."""
    stopped_after: int | None = None
    """The batches read when a stop signal ended the evaluation early (``loss`` is then NaN and
    means nothing); None when it read them all."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


def evaluate(engine: Engine, loader: DataLoader, batches: int,
             stop_signalled: Callable[[], bool] | None = None) -> EvalResult:
    """Collective over the whole job: every rank must call it at the same step.
    ``stop_signalled``: collective, asked after each batch but the last; True ends the
    evaluation there, on every rank, with no loss (`EvalResult.stopped_after`)."""
    t0 = time.perf_counter()
    engine.param_buffer.wait()  # ZeRO: the last update's parameter all-gathers
    m = engine.micro_batches
    total = None
    for b in range(batches):
        value = _forward_batch(engine, loader, b, m)
        if value is not None:
            total = value if total is None else total + value
        if stop_signalled is not None and b + 1 < batches and stop_signalled():
            return EvalResult(loss=math.nan, seconds=time.perf_counter() - t0,
                              stopped_after=b + 1)
    g = engine.groups
    contributes = g.is_last_stage and g.tp_rank == 0 and total is not None
    # on the host: the world group's device backend (NCCL) would build a communicator of every
    # rank for these two numbers, at the first eval (seconds, GPU memory on each at 12,288)
    sums = torch.tensor([float(total) if contributes else 0.0,
                         float(batches * m) if contributes else 0.0], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    loss = float(sums[0] / sums[1]) if float(sums[1]) else math.nan
    return EvalResult(loss=loss, seconds=time.perf_counter() - t0)


def _forward_batch(engine: Engine, loader: DataLoader, batch: int, m: int) -> torch.Tensor | None:
    """Sum of this rank's micro-batch losses of one eval batch (None off the last stage)."""
    if engine.pipeline is not None:
        from mscale.parallel.pipeline.forward_only import run_pipeline_forward

        return run_pipeline_forward(engine.pipeline, lambda j: loader.get(batch, j), m)
    model = engine.chunks[0]
    total = None
    with torch.no_grad(), engine.precision.cast_scope():
        for j in range(m):
            tokens, labels = (to_device(t, engine.device) for t in loader.get(batch, j))
            with engine.precision.autocast():
                loss = model(tokens, labels).detach().double()
            total = loss if total is None else total + loss
    return total
