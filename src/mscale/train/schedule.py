"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr (or constant)."""

from __future__ import annotations

import math

from mscale.config.training import TrainingConfig


def learning_rate(cfg: TrainingConfig, step: int) -> float:
    """LR for 0-based optimizer step ``step``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
