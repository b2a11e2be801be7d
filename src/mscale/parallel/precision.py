"""How forward runs: bf16 autocast around each chunk forward, inside one step-long scope.

The engine builds one `Precision` from the plan; the step (train/step.py), the pipeline runner
and the held-out evaluation enter its two contexts, so none of them reads the plan's precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """bf16 autocast around each chunk forward, inside one step-long weight-cast scope."""

    device_type: str
    bf16: bool
    """The plan's ``training.precision`` is bf16 (fp32 parameters, bf16 matmuls)."""
    share_casts: bool
    """One bf16 copy of each weight for the whole step (`cast_scope`)."""

    @classmethod
    def for_plan(cls, plan, device: torch.device) -> "Precision":
        bf16 = plan.training.precision == "bf16"
        return cls(device.type, bf16, share_casts=bf16 and plan.layout.recompute != "full")

    def autocast(self):
        """bf16 autocast when the plan asks for bf16, a no-op context otherwise. Entered around
        each chunk forward, inside `cast_scope`."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16)

    def cast_scope(self):
        """The span of one step's forwards and backwards, exited before the optimizer step: one
        bf16 copy of each weight for the whole step, shared by every micro-batch.

        Autocast caches the bf16 cast of each fp32 leaf weight until the *outermost* autocast
        context exits; with one context per chunk forward, every micro-batch in flight kept its
        own copy in its autograd graph (175B at tp 8 pp 8 v 6: ~50 GB per GPU). This is that
        outermost context, disabled, so nothing outside `autocast` runs in bf16 (backward and
        the loss sums included, as before). The cast is the same bits whichever micro-batch makes
        it, so the numerics do not change. Exiting drops the cache, so the next step casts the
        updated weights. Not under full recompute: there the graph keeps no copy, and a step-long
        cache would hold every copy that recompute otherwise drops (docs/train.md)."""
        return weight_cast_scope(self.device_type, self.share_casts)


def weight_cast_scope(device_type: str, share: bool = True):
    """An outermost autocast context that is itself disabled: autocast's cache of bf16 weight
    casts lives until it exits, shared by every autocast region inside; code between those
    regions (backward, loss sums) still runs in its own precision. A no-op if not ``share``."""
    if not share:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=False)
