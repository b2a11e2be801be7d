"""One optimizer step (`train_step`): forward and backward over its micro-batches, the DP
reduction, the norm, the NaN stop, clipping and the update.

Without pipelining this is gradient accumulation: every micro-batch but the last runs with the
DP reduction held back, and on the last one each gradient bucket starts its reduction as soon as
backward has produced it, so communication overlaps the rest of backward. With pipelining the
schedule (parallel/pipeline/runner.py) owns the order of forwards and backwards.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from mscale.distributed.init import to_device
from mscale.train.schedule import learning_rate
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


@dataclass
class StepResult:
    """What one optimizer step produced on this rank."""

    device_loss: torch.Tensor | None
    """This rank's mean loss over the step's micro-batches (None off the last stage), still on
    the device: the metrics gather reads it once per step."""
    grad_norm: float
    """Global gradient norm before clipping (identical on every rank)."""
    threshold: float
    """Clipping threshold in force."""
    lr: float
    """Learning rate used."""
    finite: bool
    """False when the norm was NaN/Inf: the optimizer step was not taken."""

    @property
    def loss(self) -> float | None:
        """The mean loss as a number (waits for the device: not on the per-step path)."""
        return None if self.device_loss is None else float(self.device_loss)


def train_step(engine: Engine, step: int, timer: StepTimer,
               before_update: Callable[[], None] = lambda: None) -> StepResult:
    """One optimizer step: micro-batches, DP reduction, norm, NaN stop, clipping, update.

    ``before_update`` runs just before the optimizer changes the state: a checkpoint whose host
    copy overlaps this step's forward/backward waits there until the copy is done
    (`Checkpointer.before_update`, docs/ckpt.md). DP communication the step waits for is
    ``comm_wait``: the reduction's wait as a region (on a GPU, how long the stream waited), the
    optimizer's parameter all-gather through COMM_CLOCK."""
    engine.faults.begin_step(step)
    loss = run_micro_batches(engine, step, timer)
    with timer.region("comm_wait", link="dp"):
        engine.grads.finish()
    norm = engine.optimizer.grad_norm()
    threshold = engine.clipper.threshold()
    lr = learning_rate(engine.plan.training, step)
    if not math.isfinite(norm):
        return StepResult(loss, norm, threshold, lr, finite=False)
    before_update()
    engine.optimizer.step(lr, clip_coef=min(1.0, threshold / (norm + 1e-6)))
    engine.clipper.update(norm)
    return StepResult(loss, norm, threshold, lr, finite=True)


def job_loss(engine: Engine, result: StepResult) -> float:
    """Collective: the step's loss, averaged over the data-parallel ranks, on every rank (it is
    computed on the last pipeline stage only). NaN and Inf survive the sum, as they must: the
    NaN stop's line reports them."""
    g = engine.groups
    mine = g.is_last_stage and g.tp_rank == 0 and result.device_loss is not None
    # on the host, as `evaluate`'s sums: a device tensor on the world group would build a
    # world-wide NCCL communicator at the NaN stop, where a slow or failed one turns exit 2 to 3
    share = (result.device_loss.detach().to("cpu", torch.float64).reshape(()) / g.dp_size if mine
             else torch.zeros((), dtype=torch.float64))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(share)
    return float(share)
