"""Forward and backward over one step's micro-batches.

Without pipelining this is gradient accumulation: every micro-batch but the last runs with the
DP reduction held back, and on the last one each gradient bucket starts its reduction as soon as
backward has produced it, so communication overlaps the rest of backward. With pipelining the
schedule (parallel/pipeline.py) owns the order of forwards and backwards.
"""

from __future__ import annotations

import contextlib
import time

import torch

from mscale.train.timers import StepTimer


def forward_backward(engine, step: int, timer: StepTimer) -> float | None:
    """Run one step's micro-batches; return this rank's mean loss (None off the last stage)."""
    if engine.plan.layout.pp > 1:
        from mscale.parallel.pipeline import run_pipeline_step

        return run_pipeline_step(engine, step, timer)
    model = engine.chunks[0]
    m = engine.micro_batches
    delay = engine.options.inject_delay.get(engine.env.rank, 0.0)
    total = 0.0
    for j in range(m):
        with timer.region("data"):
            tokens, labels = engine.loader.get(step, j)
            tokens, labels = tokens.to(engine.device), labels.to(engine.device)
        sync = contextlib.nullcontext() if j == m - 1 else engine.grads.no_sync()
        with sync:
            with engine.autocast():
                loss = model(tokens, labels)
            loss = poison_if_asked(engine, step, loss)
            (loss / m).backward()
        total += float(loss.detach())
        if delay:
            time.sleep(delay / m)  # test hook: a slow GPU, spread over the step's compute
    return total / m


def poison_if_asked(engine, step: int, loss: torch.Tensor) -> torch.Tensor:
    """Test hook (--inject-nan STEP): make the loss NaN so that NaN flows through backward into
    every gradient, exactly as a real numerical blow-up would."""
    if engine.options.inject_nan_step == step + 1:
        return loss * float("nan")
    return loss
