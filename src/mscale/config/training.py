"""How to train: batch, precision, optimizer, and the memory-saving choices.

Fields that the planner may choose (micro-batch, ZeRO stage, recompute) are optional here: leave
them out and `mscale plan` searches them; set them and the search is restricted to that value.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from mscale.config.base import FieldError, StrictModel

Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp32"]
Stack = Literal["mscale", "megascale", "megatron-lm", "megatron-core", "megatron-deepspeed",
                "llama3"]
"""Stack profile names (planner/stacks.py defines each; a test keeps the two lists equal)."""
ZeroStage = Annotated[int, Field(ge=0, le=2)]
"""0, 1 or 2 (an int, not a Literal: pydantic's Literal[0, 1, 2] would accept ``true`` as 1)."""

MAX_BATCH = 1 << 24
"""Largest global batch in sequences (16.7M; Llama 3 trained with a few thousand)."""
MAX_MICRO_BATCH = 1 << 16
"""Largest micro-batch in sequences."""
MAX_STEPS = 10**9
"""Most optimizer steps (and warm-up or checkpoint-interval steps) a run may ask for."""


class DataConfig(StrictModel):
    """Where tokens come from."""

    kind: Literal["synthetic", "tokens"] = "synthetic"
    """``synthetic``: a seeded random stream (demos, tests); ``tokens``: a memory-mapped token file."""
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    """Token file (flat array of uint16 or uint32) for ``kind: tokens``."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of the token file."""

    @model_validator(mode="after")
    def _path(self) -> "DataConfig":
        if self.kind == "tokens" and not self.path:
            raise FieldError("path", "kind 'tokens' needs a path: a flat uint16/uint32 token file")
        return self


class TrainingConfig(StrictModel):
    """Training settings, e.g. the ``training:`` section of a plan."""

    schema_version: int = Field(default=1, ge=1, le=1)
    """Version of this schema."""
    global_batch: int = Field(gt=0, le=MAX_BATCH)
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int | None = Field(default=None, gt=0, le=MAX_MICRO_BATCH)
    """Sequences per micro-batch per replica; at most ``global_batch``. None: the planner
    chooses."""
    precision: Precision = "bf16"
    """Compute precision: bf16 autocast with fp32 master weights, or plain fp32."""
    optimizer: Literal["adamw", "lamb"] = "adamw"
    """AdamW, or LAMB (layer-wise trust ratio; MegaScale §3.4 used it for 3x batch)."""
    zero_stage: ZeroStage | None = None
    """0: replicated optimizer; 1: optimizer state sharded over DP; 2: gradients too. None: search."""
    recompute: Recompute | None = None
    """Activation recomputation. None: the planner chooses the cheapest that fits."""
    steps: int = Field(default=100, gt=0, le=MAX_STEPS)
    """Optimizer steps to run."""
    lr: float = Field(default=3e-4, gt=0, le=10)
    """Peak learning rate."""
    min_lr: float = Field(default=3e-5, ge=0, le=10)
    """Floor of the cosine decay; at most ``lr``."""
    warmup_steps: int = Field(default=10, ge=0, le=MAX_STEPS)
    """Linear warm-up steps."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """Shape after warm-up."""
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    """Decoupled weight decay (not applied to norms)."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam/LAMB first-moment decay."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Adam/LAMB second-moment decay."""
    eps: float = Field(default=1e-8, gt=0, le=1)
    """Adam/LAMB epsilon."""
    grad_clip: float = Field(default=1.0, gt=0, le=1e6)
    """Gradient-norm clipping threshold (the ceiling when adaptive clipping is on)."""
    adaptive_clip: bool = True
    """Clip at a multiple of the recent gradient-norm average instead of a fixed value (docs/train.md)."""
    seed: int = Field(default=1234, ge=0, lt=2**32)
    """Seed for initialisation and synthetic data; the same seed gives the same run at any layout."""
    bucket_mb: float = Field(default=25.0, gt=0, le=65536)
    """Gradient bucket size for overlapped data-parallel reduction, in MB."""
    overlap_grad_reduce: bool = True
    """Start each bucket's reduction during backward as soon as its gradients are ready."""
    data: DataConfig = DataConfig()
    """Token source."""
    checkpoint_interval: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Steps between checkpoints. None: the plan's recommendation."""
    stack: Stack | None = None
    """Training software whose overlaps and kernels the planner prices (docs/plan.md, "Stack
    profiles"): ``mscale`` (this engine; the default), ``megascale``, ``megatron-lm`` (as in the
    2021-22 papers), ``megatron-core`` (current defaults), ``megatron-deepspeed``, ``llama3``."""

    @model_validator(mode="after")
    def _consistent(self) -> "TrainingConfig":
        if self.min_lr > self.lr:
            raise FieldError("min_lr", f"{self.min_lr:g} is above lr ({self.lr:g})")
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise FieldError("micro_batch", f"{self.micro_batch} is larger than global_batch "
                             f"({self.global_batch})")
        return self
