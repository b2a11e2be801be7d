"""The model: a GPT/LLaMA-class decoder, described by the few numbers that fix its cost.

Every number has bounds: a layer count of 10^9 or a NaN epsilon is a typo, and it is cheaper to
say so when the file is read than after a planner run or a model build has gone wrong.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mscale.config.base import FieldError, StrictModel

MAX_LAYERS = 10_000
MAX_WIDTH = 1_000_000
"""Largest hidden size (and number of heads); today's largest models are ~25k wide."""
MAX_FFN = 10_000_000
MAX_VOCAB = 10_000_000
MAX_SEQ = 100_000_000
"""Longest sequence (or window, or pre-training context) accepted; 10M-token contexts exist."""


def _count(maximum: int, default=...):
    """A positive integer field bounded by ``maximum``."""
    return Field(default=default, gt=0, le=maximum)


class RopeScaling(StrictModel):
    """Llama-3.1's rotary frequency scaling (HF ``rope_type: llama3``): long wavelengths are
    stretched by ``factor``, short ones kept, those in between interpolated smoothly, so a model
    pre-trained at ``original_max_position_embeddings`` tokens reads longer contexts."""

    type: Literal["llama3"] = "llama3"
    """The scaling rule; only Llama-3's is implemented."""
    factor: float = Field(ge=1.0, le=1e6)
    """Divisor of the low frequencies (8 in Llama-3.1)."""
    low_freq_factor: float = Field(gt=0, le=1e6)
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor`` (1 in Llama-3.1)."""
    high_freq_factor: float = Field(gt=0, le=1e6)
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept
    (4 in Llama-3.1); must exceed ``low_freq_factor``."""
    original_max_position_embeddings: int = _count(MAX_SEQ)
    """Context length of pre-training (8192 in Llama-3.1)."""

    @model_validator(mode="after")
    def _check(self) -> "RopeScaling":
        if self.high_freq_factor <= self.low_freq_factor:
            raise FieldError("high_freq_factor", f"must exceed low_freq_factor "
                             f"({self.low_freq_factor}), got {self.high_freq_factor}")
        return self

    def key(self) -> tuple[float, float, float, int]:
        """The numbers as a hashable tuple (the model caches rotary tables by it)."""
        return (self.factor, self.low_freq_factor, self.high_freq_factor,
                self.original_max_position_embeddings)


class ModelConfig(StrictModel):
    """A decoder-only transformer, e.g. ``plans/models/gpt-175b.yaml``."""

    schema_version: int = Field(default=1, ge=1, le=1)
    """Version of this schema."""
    name: str = Field(default="model", max_length=200)
    """Free-form name shown in reports."""
    layers: int = _count(MAX_LAYERS)
    """Number of transformer blocks."""
    hidden: int = _count(MAX_WIDTH)
    """Model width h."""
    heads: int = _count(MAX_WIDTH)
    """Attention (query) heads a; ``hidden`` must divide by it."""
    kv_heads: int | None = _count(MAX_WIDTH, None)
    """Key/value heads for grouped-query attention. Default: ``heads`` (plain multi-head)."""
    ffn_hidden: int | None = _count(MAX_FFN, None)
    """MLP inner width. Default: 4h for ``gelu``; 8h/3 rounded up to a multiple of 256 for ``swiglu``."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP kind: LLaMA's gated SwiGLU (three matrices) or GPT's GeLU (two)."""
    vocab: int = _count(MAX_VOCAB)
    """Vocabulary size V (the embedding's rows, padding included)."""
    real_vocab: int | None = _count(MAX_VOCAB, None)
    """Tokens actually in use when ``vocab`` was padded (an HF import pads a vocabulary that TP
    does not divide): ids from ``real_vocab`` up to ``vocab`` are padding, their logits are
    masked out, and an HF export drops their rows. None: no padding."""
    seq_len: int = _count(MAX_SEQ)
    """Training sequence length s."""
    parallel_block: bool = False
    """Attention and MLP read the same normalised input and their outputs are summed
    (GPT-J/PaLM style; MegaScale §3.1): one fewer norm, and TP communication can be fused."""
    sliding_window: int | None = _count(MAX_SEQ, None)
    """Each token attends to at most this many previous tokens (MegaScale §3.1). None = full causal."""
    tie_embeddings: bool = False
    """Share the input embedding and output projection. Only with pp = 1: the engine keeps one
    copy of the weight, so the planner searches no pipeline for a tied model and a given layout
    with pp > 1 is refused."""
    norm_eps: float = Field(default=1e-5, gt=0, le=1.0)
    """RMSNorm epsilon."""
    rope_theta: float = Field(default=10000.0, gt=0, le=1e12)
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 scaling of the rotary frequencies (long-context models such as Llama-3.1).
    None: plain rotary embeddings."""

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.hidden % self.heads:
            raise FieldError("hidden", f"{self.hidden} is not divisible by heads ({self.heads})")
        if self.heads % self.num_kv_heads:
            raise FieldError("kv_heads", f"heads ({self.heads}) is not divisible by kv_heads "
                             f"({self.kv_heads})")
        if (self.hidden // self.heads) % 2:
            raise FieldError("hidden", "the head dimension hidden/heads must be even for rotary "
                             "embeddings")
        if self.real_vocab is not None and self.real_vocab > self.vocab:
            raise FieldError("real_vocab", f"{self.real_vocab} exceeds vocab ({self.vocab})")
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

        For a GPT with a 4h GeLU MLP and learned positions this reduces to the usual
        ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` up to the bias terms that LLaMA-class models
        drop; `mscale.planner.flops.gpt_parameters` implements that formula literally.
        """
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        per_layer = attn + mlp + (1 if self.parallel_block else 2) * h
        embed = self.vocab * h * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + embed + h
