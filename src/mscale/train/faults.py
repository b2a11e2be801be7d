"""Fault injection: the one place where the test hooks of `FaultPlan` act.

The hooks (hidden CLI flags, declared once in `train/options.py`, docs/train.md) make a real job
fail the way a real fault does: a rank SIGKILLs or SIGSTOPs itself in the middle of a step (after
its first micro-batch's forward, so its peers are already inside the step's collectives), a
checkpoint write fails with a real ``OSError(ENOSPC)`` or its process is killed or stopped after
the first chunk, the loss turns NaN, a rank's compute, data loader or checkpoint writer is slowed.

`install` puts them around the engine's parts when the engine is built: forward hooks on the model
chunks, a wrapper around the batch reader, and the checkpoint writer's `WriteHooks`. The modules
they wrap (train/step.py, the pipeline runner, the data loader, ckpt/writer.py) carry no test
branch. A fault happens once: the hooks are installed only in attempt 1 of a run directory (the
loop reads the attempt number under the run lock before the engine is built), so a relaunch of
the same command, by hand or by ``mscale recover``, trains cleanly and must reproduce an
uninterrupted run's losses.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Callable

import torch

from mscale.train.options import FaultPlan

GetBatch = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


class FaultHooks:
    """This rank's hooks. ``begin_step`` is the loop's one call: the step now running."""

    def __init__(self, plan: FaultPlan, rank: int, micro_batches: int, armed: bool = True):
        self.plan, self.rank, self.m = plan, rank, micro_batches
        self.armed = armed and plan.armed
        """Any hook acts (attempt 1 with some ``--inject-*`` flag)."""
        self.step = 0
        """The step running now (1-based)."""
        self._fired = 0

    def begin_step(self, step: int) -> None:
        """The loop starts (0-based) ``step``."""
        self.step = step + 1

    # ------------------------------------------------------------------ the model
    def install_on_chunks(self, chunks: list[torch.nn.Module]) -> None:
        """Slow compute, NaN loss, crash and hang, as hooks on this rank's model chunks. They act
        on training forwards only (gradients on), not on the held-out evaluation."""
        delay = self.plan.delay.get(self.rank, 0.0)
        if delay:  # a slow GPU: the step's extra seconds spread over its forwards
            per_forward = delay / (self.m * len(chunks))
            for chunk in chunks:
                chunk.register_forward_pre_hook(lambda module, args: self._sleep(per_forward))
        if self.plan.nan_step is not None:
            for chunk in chunks:
                if getattr(chunk, "has_head", False):
                    chunk.register_forward_hook(self._poison)
        if chunks and self.rank in (self.plan.crash | self.plan.hang):
            chunks[0].register_forward_hook(self._stop_process)

    def _sleep(self, seconds: float) -> None:
        if torch.is_grad_enabled():
            time.sleep(seconds)

    def _poison(self, module, args, output):  # noqa: ARG002 - a forward hook
        """NaN in the loss flows through backward into every gradient, as a real blow-up."""
        if torch.is_grad_enabled() and self.step == self.plan.nan_step:
            return output * float("nan")
        return None

    def _stop_process(self, module, args, output) -> None:  # noqa: ARG002 - a forward hook
        kill = self.plan.crash.get(self.rank) == self.step
        hang = self.plan.hang.get(self.rank) == self.step
        if self._fired == self.step or not (kill or hang) or not torch.is_grad_enabled():
            return
        self._fired = self.step
        sys.stderr.write(f"test hook --inject-{'crash' if kill else 'hang'}: rank {self.rank} "
                         f"{'SIGKILLs' if kill else 'SIGSTOPs'} itself at step {self.step}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)

    # ------------------------------------------------------------------ data
    def wrap_get_batch(self, get_batch: GetBatch) -> GetBatch:
        """A slow data loader: this rank's extra seconds per step, spread over its reads."""
        delay = self.plan.data_delay.get(self.rank, 0.0)
        if not delay or not self.armed:
            return get_batch

        def slow_get_batch(step: int, micro: int):
            time.sleep(delay / self.m)
            return get_batch(step, micro)
        return slow_get_batch

    # ------------------------------------------------------------------ checkpoints
    def write_hooks(self, step: int) -> "CheckpointFaults | None":
        """What the writer of the save of ``step`` calls (`ckpt.writer.WriteHooks`), if any."""
        p = self.plan
        fault = ("kill" if p.ckpt_kill.get(self.rank) == step else
                 "hang" if p.ckpt_hang.get(self.rank) == step else
                 "enospc" if p.ckpt_enospc_step == step else
                 "eio" if p.ckpt_eio_step == step else None)
        if not self.armed or not (fault or p.ckpt_chunk_delay_s or p.ckpt_copy_delay_s):
            return None
        return CheckpointFaults(fault, p.ckpt_chunk_delay_s, p.ckpt_copy_delay_s)


class CheckpointFaults:
    """`ckpt.writer.WriteHooks` of one save: a slow copy, a slow filesystem, and the injected
    fault after the first chunk (the chunks so far flushed first, so the attempt leaves a
    partial shard behind as a real crash does)."""

    def __init__(self, fault: str | None, chunk_delay_s: float = 0.0, copy_delay_s: float = 0.0):
        self.fault, self.chunk_delay_s, self.copy_delay_s = fault, chunk_delay_s, copy_delay_s

    def before_copy(self) -> None:
        time.sleep(self.copy_delay_s)

    def after_chunk(self, fh, path: str, index: int) -> None:
        time.sleep(self.chunk_delay_s)
        if self.fault is None or index != 0:
            return
        fh.flush()
        if self.fault in ("enospc", "eio"):
            code = errno.ENOSPC if self.fault == "enospc" else errno.EIO
            raise OSError(code, f"{os.strerror(code)} (test hook --inject-ckpt-{self.fault})",
                          path)
        kill = self.fault == "kill"
        sys.stderr.write(f"test hook --inject-ckpt-{self.fault}: this rank "
                         f"{'SIGKILLs' if kill else 'SIGSTOPs'} itself writing {path}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)


def install(plan: FaultPlan, rank: int, micro_batches: int, chunks: list[torch.nn.Module],
            attempt: int = 1) -> FaultHooks:
    """This rank's hooks, with the model's installed (the engine wraps its batch reader and
    passes `FaultHooks.write_hooks` to the checkpointer). From attempt 2 on none acts."""
    hooks = FaultHooks(plan, rank, micro_batches, armed=attempt == 1)
    if hooks.armed:
        hooks.install_on_chunks(chunks)
    return hooks
