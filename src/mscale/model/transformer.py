"""A LLaMA-class decoder in plain PyTorch, that also serves as one pipeline stage.

Read top to bottom: RMSNorm, rotary embeddings, the attention core, grouped-query attention, the
MLP, the block, the model. Every layer is a stock `nn.Linear`/`nn.Embedding`; nothing here knows
about parallelism. `mscale.parallel.parallelize` applies tensor and sequence parallelism,
activation recompute and the pipeline split to this model for a given plan (torchtitan's
split), so this file can be read, and compared with `transformers`' Llama, line by line.

Activations are sequence-first ``[s, b, h]``: under sequence parallelism a shard is then a
contiguous slice of dim 0. Head counts are read from the projections' outputs (``view(..., -1,
head_dim)``), so the same code runs on a tensor-parallel rank's share of the heads.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mscale.config.model import ModelConfig
from mscale.errors import MscaleError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm computed in fp32, times the gain, in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class RMSNorm(nn.Module):
    """`rms_norm` with a learned gain (starts at one; no weight decay)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """The ``d/2`` rotary inverse frequencies, fp64; with ``scaling`` (`RopeScaling.key`:
    factor, low_freq_factor, high_freq_factor, original context) Llama-3's rule: wavelengths
    longer than ``original / low`` are divided by ``factor``, those shorter than
    ``original / high`` kept, and those in between interpolated (as HF's ``rope_type: llama3``)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, scaled))


@functools.lru_cache(maxsize=16)
def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  scaling: tuple[float, float, float, int] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[s, 1, 1, d/2]`` of position × frequency, shared by every block."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    shape = (seq_len, 1, 1, head_dim // 2)
    return (angles.cos().float().reshape(shape).to(device),
            angles.sin().float().reshape(shape).to(device))


def apply_rotary(x: torch.Tensor, theta: float,
                 scaling: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by its position (rotate-half / GPT-NeoX pairing), so that
    the dot product of a query and a key depends only on their distance."""
    # under torch.compile the tables are traced, not cached (dynamo would bypass the cache anyway)
    tables = rotary_tables.__wrapped__ if torch.compiler.is_compiling() else rotary_tables
    cos, sin = tables(x.shape[0], x.shape[-1], theta, x.device, scaling)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


@functools.lru_cache(maxsize=8)
def sliding_window_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """``[s, s]`` boolean, True where query i may attend key j: ``i - window < j <= i``.

    A window of W means each token sees W tokens, itself included (W=1: only itself).
    """
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


# enable_gqa (torch >= 2.5) lets the kernel read each K/V head for its query group in place.
_SDPA_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention on local heads, ``[b, heads, s, d]``."""
    extra = {}
    if k.shape[1] != q.shape[1]:
        if _SDPA_GQA:
            extra["enable_gqa"] = True
        else:  # pragma: no cover - old torch
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q.shape[2]
    if window is None or window >= s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    masks = sliding_window_mask
    if torch.compiler.is_compiling():  # traced, not cached (as apply_rotary's tables)
        masks = sliding_window_mask.__wrapped__
    mask = masks(s, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class CausalAttention(nn.Module):
    """`attention_core` as a module without parameters, so that the parallelize step can wrap
    exactly this part in activation recompute (``recompute: selective``)."""

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_core(q, k, v, self.window)


class Attention(nn.Module):
    """Grouped-query attention: ``heads`` queries share ``kv_heads`` keys and values."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.head_dim
        self.head_dim, self.theta = d, cfg.rope_theta
        self.scaling = cfg.rope_scaling.key() if cfg.rope_scaling else None
        self.wq = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
        self.core = CausalAttention(cfg.sliding_window)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s, b, _ = h.shape
        q = apply_rotary(self.wq(h).view(s, b, -1, self.head_dim), self.theta, self.scaling)
        k = apply_rotary(self.wk(h).view(s, b, -1, self.head_dim), self.theta, self.scaling)
        v = self.wv(h).view(s, b, -1, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # SDPA wants [b, heads, s, d]
        out = self.core(q, k, v)
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    """SwiGLU (LLaMA: gate, up, down) or GeLU (GPT: up, down)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(F.silu(self.gate(h)) * self.up(h))
        return self.down(F.gelu(self.up(h)))


class Block(nn.Module):
    """One transformer block, sequential (two norms) or parallel (one norm; MegaScale §3.1:
    attention and MLP read the same normalised input and their outputs are summed, which under
    tensor parallelism halves the block's collectives)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel = cfg.parallel_block
        if self.parallel:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        else:
            self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = self.norm(x)
            return x + (self.attn(h) + self.mlp(h))
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """The model, or the pipeline stage holding blocks ``layer_ids`` (global indices).

    Parameter names are global (``embed.weight``, ``layers.{i}.attn.wq.weight``,
    ``final_norm.weight``, ``head.weight``; no ``head`` when the embedding is tied), so they are
    the same at every layout. `mscale.model.params.init_weights` sets the initial values; the
    engine instead builds this on the meta device and lets the parallelize step materialise
    each rank's shards with the same values.
    """

    def __init__(self, cfg: ModelConfig, *, layer_ids: list[int] | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        super().__init__()
        _check(cfg, layer_ids, has_embedding, has_head)
        self.cfg, self.has_embedding, self.has_head = cfg, has_embedding, has_head
        self.layer_ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        if has_embedding:
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in self.layer_ids})
        if has_head:
            self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            if not cfg.tie_embeddings:
                self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage.

        ``x``: token ids ``[b, s]`` if this stage has the embedding, else the hidden states the
        previous stage returned. Returns, in order of precedence: the mean loss over the
        micro-batch's tokens (head and ``labels`` ``[b, s]`` given); the logits ``[b, s, V]``
        (head, no labels; a transposed view); or the hidden states ``[s, b, h]`` for the next
        stage.
        """
        h = self.embed(x.t()) if self.has_embedding else x
        for block in self.layers.values():
            h = block(h)
        if not self.has_head:
            return h
        logits = self.logits(self.final_norm(h))
        if labels is None:
            return logits.transpose(0, 1)
        return self.loss(logits, labels.t())

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.cfg.tie_embeddings else self.head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[s, b, V]`` from the normalised hidden states."""
        return mask_padding(F.linear(h, self.output_weight()), self.cfg.real_vocab, first_id=0)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token, in fp32."""
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def mask_padding(logits: torch.Tensor, real_vocab: int | None, first_id: int) -> torch.Tensor:
    """Padded vocabulary ids (``real_vocab`` ≤ id < ``vocab``; an HF import that TP does not
    divide) get the lowest finite logit, so that they take no probability and no gradient and the
    loss is the unpadded model's. ``first_id``: the id of ``logits[..., 0]`` (a TP rank holds a
    slice of the vocabulary). Finite, not -inf: a rank holding only padding would otherwise turn
    the cross-entropy's ``shifted * inside`` into NaN."""
    per_rank = logits.shape[-1]
    if real_vocab is None or real_vocab >= first_id + per_rank:
        return logits
    ids = torch.arange(first_id, first_id + per_rank, device=logits.device)
    return logits.masked_fill(ids >= real_vocab, torch.finfo(logits.dtype).min)


def _check(cfg: ModelConfig, layer_ids: list[int] | None, has_embedding: bool,
           has_head: bool) -> None:
    if cfg.tie_embeddings and not (has_embedding and has_head):
        raise MscaleError("tied embeddings need the embedding and the head on the same stage",
                          field="model.tie_embeddings",
                          fix="set tie_embeddings: false, or train without pipeline parallelism")
    bad = [i for i in (layer_ids or []) if not 0 <= i < cfg.layers]
    if bad or (layer_ids is not None and len(set(layer_ids)) != len(layer_ids)):
        raise ValueError(f"layer_ids {layer_ids} must be distinct indices below {cfg.layers}")
