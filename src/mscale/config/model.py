"""The model: a GPT/LLaMA-class decoder, described by the few numbers that fix its cost."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mscale.config.base import StrictModel


class ModelConfig(StrictModel):
    """A decoder-only transformer, e.g. ``plans/models/gpt-175b.yaml``."""

    schema_version: int = 1
    """Version of this schema."""
    name: str = "model"
    """Free-form name shown in reports."""
    layers: int = Field(gt=0)
    """Number of transformer blocks."""
    hidden: int = Field(gt=0)
    """Model width h."""
    heads: int = Field(gt=0)
    """Attention (query) heads a; ``hidden`` must divide by it."""
    kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads for grouped-query attention. Default: ``heads`` (plain multi-head)."""
    ffn_hidden: int | None = Field(default=None, gt=0)
    """MLP inner width. Default: 4h for ``gelu``; 8h/3 rounded up to a multiple of 256 for ``swiglu``."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP kind: LLaMA's gated SwiGLU (three matrices) or GPT's GeLU (two)."""
    vocab: int = Field(gt=0)
    """Vocabulary size V."""
    seq_len: int = Field(gt=0)
    """Training sequence length s."""
    parallel_block: bool = False
    """Attention and MLP read the same normalised input and their outputs are summed
    (GPT-J/PaLM style; MegaScale §3.1): one fewer norm, and TP communication can be fused."""
    sliding_window: int | None = Field(default=None, gt=0)
    """Each token attends to at most this many previous tokens (MegaScale §3.1). None = full causal."""
    tie_embeddings: bool = False
    """Share the input embedding and output projection."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError("head dimension hidden/heads must be even for rotary embeddings")
        return self

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        """The MLP inner width actually used."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.hidden
        return -(-(8 * self.hidden // 3) // 256) * 256

    def num_parameters(self) -> int:
        """Exact parameter count of the model as mscale builds it (norm weights included).

        For a GPT with a 4h GeLU MLP and learned positions this reduces to facts.md's
        ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` up to the bias terms that LLaMA-class models
        drop; `mscale.planner.flops.gpt_parameters` implements that formula literally.
        """
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        per_layer = attn + mlp + (1 if self.parallel_block else 2) * h
        embed = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embed + h
