"""Adaptive gradient clipping: the threshold follows recent gradient norms.

A fixed threshold is either too high to catch a spike late in training (norms shrink as the loss
falls) or so low that it clips every step early on. The rule here:

- ``threshold = grad_clip`` for the first ``warmup`` steps, and always when adaptive clipping is
  off (``training.adaptive_clip: false``);
- afterwards ``threshold = min(grad_clip, k · EMA)``, where EMA is the bias-corrected exponential
  moving average (decay ``beta``) of recent gradient norms: ``grad_clip`` stays the ceiling;
- the EMA is fed ``min(norm, threshold)``, the norm *after* clipping, so a spike is clipped and
  moves the average by at most what a norm at the threshold would: one bad batch cannot raise the
  threshold that is meant to catch the next one. A real upward drift is still followed, at most
  by a factor ``1 + (1 - beta)(k - 1)`` per step (about 3% with the defaults);
- a non-finite norm (a skipped step) does not touch the state.

The whole state is `state_dict()`: ``{"version", "ema", "count"}``, saved with the checkpoint so a
resumed run clips exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math


class AdaptiveClipper:
    """Clip threshold from a moving average of gradient norms (rule in the module docstring)."""

    VERSION = 1

    def __init__(self, grad_clip: float, adaptive: bool = True, k: float = 2.5,
                 beta: float = 0.98, warmup: int = 20):
        if grad_clip <= 0 or k <= 1 or not 0 < beta < 1 or warmup < 0:
            raise ValueError("need grad_clip > 0, k > 1, 0 < beta < 1, warmup >= 0")
        self.grad_clip, self.adaptive = grad_clip, adaptive
        self.k, self.beta, self.warmup = k, beta, warmup
        self.ema = 0.0
        self.count = 0

    @classmethod
    def from_config(cls, training) -> "AdaptiveClipper":
        """From a TrainingConfig: ``grad_clip`` is the ceiling, ``adaptive_clip`` the switch."""
        return cls(training.grad_clip, adaptive=training.adaptive_clip)

    def average(self) -> float | None:
        """Bias-corrected EMA of (clipped) norms; None before the first finite norm."""
        if self.count == 0:
            return None
        return self.ema / (1 - self.beta ** self.count)

    def threshold(self) -> float:
        """The clip threshold for the current step."""
        if not self.adaptive or self.count < self.warmup or self.count == 0:
            return self.grad_clip
        return min(self.grad_clip, self.k * self.average())

    def update(self, norm: float) -> None:
        """Feed this step's gradient norm (before clipping), after the step used `threshold`."""
        if not math.isfinite(norm):
            return
        value = min(norm, self.threshold())
        self.ema = self.beta * self.ema + (1 - self.beta) * value
        self.count += 1

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "ema": self.ema, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != self.VERSION:
            raise ValueError(f"clip state version {state.get('version')} != {self.VERSION}")
        self.ema, self.count = float(state["ema"]), int(state["count"])
