"""A LLaMA-class decoder, tensor- and sequence-parallel, that also serves as one pipeline stage.

Read top to bottom: RMSNorm, rotary embeddings, the attention core, grouped-query attention, the
MLP, the block, the model. Activations are sequence-first ``[s, b, h]`` (a sequence-parallel
shard is a contiguous slice of dim 0). The residual stream is replicated over TP ranks, or
split along the sequence under SP; everything between `TensorParallel.enter` and
`TensorParallel.exit` sees the full sequence and 1/tp of the heads or of the MLP width.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mscale.config.model import ModelConfig
from mscale.errors import MscaleError
from mscale.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                    VocabParallelEmbedding, copy_to_tp, gather_from_sp,
                                    name_parameters, sharded_parameter,
                                    vocab_parallel_cross_entropy)

RECOMPUTE = ("none", "selective", "full")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32.

    Under SP each TP rank normalises a different slice of the sequence, so each holds only part
    of the gain's gradient: routing the gain through `copy_to_tp` all-reduces that gradient in
    backward, and every TP rank ends with the same complete gradient for the replicated gain.
    """

    def __init__(self, hidden: int, eps: float, tp: TensorParallel):
        super().__init__()
        self.eps, self.tp = eps, tp
        self.weight = sharded_parameter((hidden,), tp, tp_dim=None, weight_decay=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp(self.weight, self.tp) if self.tp.sp else self.weight
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * weight


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
    cos, sin = rotary_tables(x.shape[0], x.shape[-1], theta, x.device, scaling)
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
    mask = sliding_window_mask(s, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class Attention(nn.Module):
    """Grouped-query attention with heads split over TP (each rank: heads/tp queries and
    kv_heads/tp keys/values, which are exactly the K/V heads its query heads use).

    Takes the entered (full-sequence) input; returns the partial output, to be summed by
    `TensorParallel.exit`.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute_core: bool):
        super().__init__()
        d = cfg.head_dim
        self.head_dim, self.theta, self.window = d, cfg.rope_theta, cfg.sliding_window
        self.scaling = cfg.rope_scaling.key() if cfg.rope_scaling else None
        self.local_heads = cfg.heads // tp.size
        self.local_kv_heads = cfg.num_kv_heads // tp.size
        self.recompute_core = recompute_core
        self.wq = ColumnParallelLinear(cfg.hidden, cfg.heads * d, tp)
        self.wk = ColumnParallelLinear(cfg.hidden, cfg.num_kv_heads * d, tp)
        self.wv = ColumnParallelLinear(cfg.hidden, cfg.num_kv_heads * d, tp)
        self.wo = RowParallelLinear(cfg.heads * d, cfg.hidden, tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s, b, _ = h.shape
        q = apply_rotary(self.wq(h).view(s, b, self.local_heads, self.head_dim), self.theta,
                         self.scaling)
        k = apply_rotary(self.wk(h).view(s, b, self.local_kv_heads, self.head_dim), self.theta,
                         self.scaling)
        v = self.wv(h).view(s, b, self.local_kv_heads, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # SDPA wants [b, heads, s, d]
        if self.recompute_core:  # selective: drop the s×s-sized intermediates, keep the rest
            out = checkpoint(attention_core, q, k, v, self.window, use_reentrant=False)
        else:
            out = attention_core(q, k, v, self.window)
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (LLaMA: gate, up, down) or GeLU (GPT: up, down), width split over TP."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.gate = ColumnParallelLinear(cfg.hidden, cfg.ffn, tp)
        self.up = ColumnParallelLinear(cfg.hidden, cfg.ffn, tp)
        self.down = RowParallelLinear(cfg.ffn, cfg.hidden, tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(F.silu(self.gate(h)) * self.up(h))
        return self.down(F.gelu(self.up(h)))


class Block(nn.Module):
    """One transformer block, sequential (two norms) or parallel (one norm; MegaScale §3.1).

    In the parallel form attention and MLP read the same normalised input, so they share one
    `enter` and their partial outputs are summed before one `exit`: half the TP collectives.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, recompute_core: bool):
        super().__init__()
        self.tp, self.parallel = tp, cfg.parallel_block
        if self.parallel:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, tp)
        else:
            self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, tp)
            self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, tp)
        self.attn = Attention(cfg, tp, recompute_core)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if self.parallel:
            h = tp.enter(self.norm(x))
            return x + tp.exit(self.attn(h) + self.mlp(h))
        x = x + tp.exit(self.attn(tp.enter(self.attn_norm(x))))
        return x + tp.exit(self.mlp(tp.enter(self.mlp_norm(x))))


class Transformer(nn.Module):
    """The model, or the pipeline stage holding blocks ``layer_ids`` (global indices).

    Parameter names are global (``embed.weight``, ``layers.{i}.attn.wq.weight``,
    ``final_norm.weight``, ``head.weight``), identical at every TP/PP layout. Parameters are
    created uninitialised: call `init_parameters(model, seed)` or load a checkpoint.

    ``autocast_dtype`` (e.g. torch.bfloat16) runs forward under torch.autocast with fp32
    parameters; None (the default) computes in the parameters' dtype.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, *, layer_ids: list[int] | None = None,
                 has_embedding: bool = True, has_head: bool = True, recompute: str = "none",
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        _check(cfg, tp, layer_ids, has_embedding, has_head, recompute)
        self.cfg, self.tp, self.recompute, self.autocast_dtype = cfg, tp, recompute, autocast_dtype
        self.has_embedding, self.has_head = has_embedding, has_head
        self.layer_ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        if has_embedding:
            self.embed = VocabParallelEmbedding(cfg.vocab, cfg.hidden, tp)
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp, recompute == "selective")
                                     for i in self.layer_ids})
        if has_head:
            self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, tp)
            if not cfg.tie_embeddings:
                self.head = ColumnParallelLinear(cfg.hidden, cfg.vocab, tp)
        name_parameters(self)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage.

        ``x``: token ids ``[b, s]`` if this stage has the embedding, else the hidden states the
        previous stage returned. Returns, in order of precedence: the mean loss over the
        micro-batch's tokens (head and ``labels`` ``[b, s]`` given); the logits ``[b, s, V/tp]``
        (head, no labels; this rank's vocabulary slice, a transposed view); or the hidden states
        ``[s, b, h]`` for the next stage (``[s/tp, b, h]``, this rank's sequence shard, under SP).
        """
        with self._precision(x.device):
            h = self.embed(x.t()) if self.has_embedding else x
            for block in self.layers.values():
                if self.recompute == "full":  # keep only each block's input; redo it in backward
                    h = checkpoint(block, h, use_reentrant=False)
                else:
                    h = block(h)
            if not self.has_head:
                return h
            logits = self._logits(h)
            if labels is None:
                return logits.transpose(0, 1)
            return vocab_parallel_cross_entropy(logits, labels.t(), self.tp)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[s, b, V/tp]``: the full sequence on every TP rank, this rank's vocabulary slice."""
        h = self.final_norm(h)
        h = gather_from_sp(h, self.tp) if self.tp.sp else copy_to_tp(h, self.tp)
        weight = self.embed.weight if self.cfg.tie_embeddings else self.head.weight
        return self._mask_padding(F.linear(h, weight))

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padded vocabulary ids (``real_vocab`` ≤ id < ``vocab``) get the lowest finite logit,
        so that they take no probability and no gradient and the loss is the unpadded model's.
        Finite, not -inf: a rank holding only padding would otherwise turn the cross-entropy's
        ``shifted * inside`` into NaN."""
        real = self.cfg.real_vocab
        per_rank = logits.shape[-1]
        first = self.tp.rank * per_rank
        if real is None or real >= first + per_rank:
            return logits
        ids = torch.arange(first, first + per_rank, device=logits.device)
        return logits.masked_fill(ids >= real, torch.finfo(logits.dtype).min)

    def _precision(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


def _check(cfg: ModelConfig, tp: TensorParallel, layer_ids: list[int] | None,
           has_embedding: bool, has_head: bool, recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise MscaleError(f"recompute={recompute!r} is not one of {RECOMPUTE}",
                          field="training.recompute", fix="use none, selective or full")
    if cfg.tie_embeddings and not (has_embedding and has_head):
        raise MscaleError("tied embeddings need the embedding and the head on the same stage",
                          field="model.tie_embeddings",
                          fix="set tie_embeddings: false, or train without pipeline parallelism")
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.num_kv_heads), ("ffn", cfg.ffn),
                    ("vocab", cfg.vocab)):
        if n % tp.size:
            raise MscaleError(f"tp={tp.size} does not divide {what}={n}", field="layout.tp",
                              fix=f"choose tp dividing {what}")
    bad = [i for i in (layer_ids or []) if not 0 <= i < cfg.layers]
    if bad or (layer_ids is not None and len(set(layer_ids)) != len(layer_ids)):
        raise ValueError(f"layer_ids {layer_ids} must be distinct indices below {cfg.layers}")

