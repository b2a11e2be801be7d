"""Fault-injection test hooks of `mscale train`, and the rule that they fire once.

The hooks (hidden CLI flags, docs/train.md) make a real job fail the way a real fault does: a
rank SIGKILLs or SIGSTOPs itself in the middle of a step (after its first micro-batch's forward,
so its peers are already inside the step's collectives), a checkpoint write fails with a real
``OSError(ENOSPC)`` or its process is killed or stopped after the first chunk (ckpt/writer.py),
the loss turns NaN, a rank or its data loader is slowed.

A fault happens once. Every hook fires only in attempt 1 of a run directory (the attempt number
rank 0 reads under the run lock, agreed by every rank): a relaunch of the same command, by hand
or by ``mscale recover``, trains cleanly and must reproduce an uninterrupted run's losses.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import torch


@dataclasses.dataclass
class StepFaults:
    """This rank's mid-step faults (``--inject-crash``/``--inject-hang``), fired by a forward
    hook on its first model chunk: every stage runs a forward, with or without pipelining."""

    rank: int
    crash_step: int | None = None
    """1-based step at which this rank SIGKILLs itself."""
    hang_step: int | None = None
    """1-based step at which this rank SIGSTOPs itself."""
    step: int = 0
    """The step running now (1-based), set by the loop."""
    fired: int = 0
    """The last step whose fault fired (at most once per step)."""

    @property
    def armed(self) -> bool:
        return self.crash_step is not None or self.hang_step is not None

    def begin_step(self, step: int) -> None:
        """The loop starts (0-based) ``step``."""
        self.step = step + 1

    def after_forward(self, module, inputs, output) -> None:  # noqa: ARG002 - a forward hook
        if self.fired == self.step or self.step not in (self.crash_step, self.hang_step):
            return
        self.fired = self.step
        kill = self.step == self.crash_step
        sys.stderr.write(f"test hook --inject-{'crash' if kill else 'hang'}: rank {self.rank} "
                         f"{'SIGKILLs' if kill else 'SIGSTOPs'} itself at step {self.step}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)


def install(chunks: list[torch.nn.Module], rank: int, options) -> StepFaults:
    """The step faults ``options`` ask of ``rank``, hooked onto its first chunk if any."""
    faults = StepFaults(rank, options.inject_crash.get(rank), options.inject_hang.get(rank))
    if faults.armed and chunks:
        chunks[0].register_forward_hook(faults.after_forward)
    return faults


def any_armed(options) -> bool:
    """Whether any fault hook was given (the console says when they are disarmed)."""
    c = options.ckpt
    return bool(options.inject_delay or options.inject_data_delay or options.inject_nan_step
                or options.inject_crash or options.inject_hang or c.inject_enospc_step
                or c.inject_kill or c.inject_hang)


def disarmed(options):
    """``options`` without any fault hook: what attempts after the first run with."""
    ckpt = dataclasses.replace(options.ckpt, inject_enospc_step=None, inject_kill={},
                               inject_hang={})
    return dataclasses.replace(options, inject_delay={}, inject_data_delay={},
                               inject_nan_step=None, inject_crash={}, inject_hang={}, ckpt=ckpt)


def disarm(engine) -> None:
    """Turn every hook of ``engine`` off (attempt 2 and later)."""
    engine.options = disarmed(engine.options)
    engine.faults.crash_step = engine.faults.hang_step = None
    if engine.pipeline is not None:  # the stage took its copies of the hooks when it was built
        # (a frozen dataclass: replaced, not assigned)
        engine.pipeline = dataclasses.replace(engine.pipeline, nan_step=None, delay_s=0.0)
