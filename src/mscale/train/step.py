"""Forward and backward over one step's micro-batches.

Without pipelining this is gradient accumulation: every micro-batch but the last runs with the
DP reduction held back, and on the last one each gradient bucket starts its reduction as soon as
backward has produced it, so communication overlaps the rest of backward. With pipelining the
schedule (parallel/pipeline/runner.py) owns the order of forwards and backwards.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from mscale.distributed.init import to_device
from mscale.train.timers import StepTimer

if TYPE_CHECKING:  # the engine imports nothing from here; only the type is named
    from mscale.train.engine import Engine


def forward_backward(engine: Engine, step: int, timer: StepTimer) -> float | None:
    """`run_micro_batches` with the loss read as a number: a host sync, for tests and tools
    (the training loop keeps it on the device until the metrics gather)."""
    loss = run_micro_batches(engine, step, timer)
    return None if loss is None else float(loss)


def run_micro_batches(engine: Engine, step: int, timer: StepTimer) -> torch.Tensor | None:
    """Run one step's micro-batches; return this rank's mean loss (None off the last stage).

    The loss stays a 0-dim float64 tensor on the device: reading it per micro-batch would make
    the host wait for the device every time and stop it queuing ahead. It is summed there, in
    float64 and in micro-batch order, which gives exactly the bits of the host sum it replaces,
    and read once per step by the metrics gather (train/metrics.py).
    """
    if engine.pipeline is not None:
        from mscale.parallel.pipeline import run_pipeline_step

        return run_pipeline_step(engine.pipeline, step, timer)  # the stage holds cast_scope
    # one bf16 copy of each weight for all the step's micro-batches (Precision.cast_scope)
    with engine.precision.cast_scope():
        return _accumulate(engine, step, timer)


def _accumulate(engine: Engine, step: int, timer: StepTimer) -> torch.Tensor:
    """Gradient accumulation without a pipeline: forward and backward per micro-batch."""
    model = engine.chunks[0]
    m = engine.micro_batches
    total = None
    for j in range(m):
        with timer.region("data"):
            tokens, labels = (to_device(t, engine.device) for t in engine.get_batch(step, j))
        sync = contextlib.nullcontext() if j == m - 1 else engine.grads.no_sync()
        with sync:
            with timer.work("forward", j), engine.precision.autocast():
                loss = model(tokens, labels)
            with timer.work("backward", j):
                (loss / m).backward()
        total = add_loss(total, loss)
    return total / m


def add_loss(total: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """``total + loss`` on the loss's device, in float64 (no host sync)."""
    value = loss.detach().double()
    return value if total is None else total + value
