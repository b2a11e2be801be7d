"""How to train: batch, precision, optimizer, and the memory-saving choices.

Fields that the planner may choose (micro-batch, ZeRO stage, recompute) are optional here: leave
them out and `mscale plan` searches them; set them and the search is restricted to that value.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mscale.config.base import StrictModel

Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp32"]


class DataConfig(StrictModel):
    """Where tokens come from."""

    kind: Literal["synthetic", "tokens"] = "synthetic"
    """``synthetic``: a seeded random stream (demos, tests); ``tokens``: a memory-mapped token file."""
    path: str | None = None
    """Token file (flat array of uint16 or uint32) for ``kind: tokens``."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of the token file."""

    @model_validator(mode="after")
    def _path(self) -> "DataConfig":
        if self.kind == "tokens" and not self.path:
            raise ValueError("data.kind 'tokens' needs data.path (a flat uint16/uint32 token file)")
        return self


class TrainingConfig(StrictModel):
    """Training settings, e.g. the ``training:`` section of a plan."""

    schema_version: int = 1
    """Version of this schema."""
    global_batch: int = Field(gt=0)
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int | None = Field(default=None, gt=0)
    """Sequences per micro-batch per replica. None: the planner chooses."""
    precision: Precision = "bf16"
    """Compute precision: bf16 autocast with fp32 master weights, or plain fp32."""
    optimizer: Literal["adamw", "lamb"] = "adamw"
    """AdamW, or LAMB (layer-wise trust ratio; MegaScale §3.4 used it for 3x batch)."""
    zero_stage: Literal[0, 1, 2] | None = None
    """0: replicated optimizer; 1: optimizer state sharded over DP; 2: gradients too. None: search."""
    recompute: Recompute | None = None
    """Activation recomputation. None: the planner chooses the cheapest that fits."""
    steps: int = Field(default=100, gt=0)
    """Optimizer steps to run."""
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(default=3e-5, ge=0)
    """Floor of the cosine decay."""
    warmup_steps: int = Field(default=10, ge=0)
    """Linear warm-up steps."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """Shape after warm-up."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay (not applied to norms)."""
    beta1: float = 0.9
    """Adam/LAMB first-moment decay."""
    beta2: float = 0.95
    """Adam/LAMB second-moment decay."""
    eps: float = 1e-8
    """Adam/LAMB epsilon."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient-norm clipping threshold (the ceiling when adaptive clipping is on)."""
    adaptive_clip: bool = True
    """Clip at a multiple of the recent gradient-norm average instead of a fixed value (docs/train.md)."""
    seed: int = 1234
    """Seed for initialisation and synthetic data; the same seed gives the same run at any layout."""
    bucket_mb: float = Field(default=25.0, gt=0)
    """Gradient bucket size for overlapped data-parallel reduction, in MB."""
    overlap_grad_reduce: bool = True
    """Start each bucket's reduction during backward as soon as its gradients are ready."""
    data: DataConfig = DataConfig()
    """Token source."""
    checkpoint_interval: int | None = Field(default=None, gt=0)
    """Steps between checkpoints. None: the plan's recommendation."""
