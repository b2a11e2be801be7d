"""Kernel time of one transformer block on one rank, from the work each kernel does.

One efficiency for every model and GPU over-predicted small models and capped large ones (issue
13). Here each part is priced by what limits it:

- **GEMMs** (Q/K/V, attention output, MLP): FLOPs / (peak · e), e from the GEMM's own shape after
  the TP split (`gemm_efficiency`: a roofline with a math ceiling per GPU generation, wave
  quantization over the SMs, and the bytes it moves), for the forward, data-gradient and
  weight-gradient orientations.
- **Attention core**: a flash kernel at a share of peak that grows with sequence length and head
  dim (`flash_efficiency`), or, without one, batched GEMMs plus the softmax/dropout traffic over
  the s×s scores at memory bandwidth.
- **Memory-bound work** (norms, residual adds, activation function, rotary embedding, the loss):
  bytes read and written / (HBM bandwidth · efficiency of the kind of kernel). Under sequence
  parallelism norms and residual work are split over the TP ranks; without it each rank repeats
  them (Korthikanti et al., arXiv 2205.05198 §4.2.2).

Every constant is in constants.py with its source. All functions take numpy arrays (tp, micro-
batch, SP, recompute per candidate layout), so the search prices every layout in one call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from mscale.config.gpus import GPUSpec
from mscale.config.model import ModelConfig
from mscale.planner.constants import (FLASH_ATTENTION, GEMM_MAX_EFFICIENCY, GEMM_MEMORY_EFFICIENCY,
                                      GEMM_TILES, HBM_GB_PER_S, MEMORY_BOUND_EFFICIENCY,
                                      SM_COUNT, SOFTMAX_BYTES_PER_SCORE)
from mscale.planner.stacks import StackProfile

FWD_SHARE_MEMORY = 0.4
"""Forward share of a block's memory-bound bytes (forward reads x and writes y; backward reads x
and dy and writes dx, ~1.5× as many): what full recompute repeats."""


@dataclass(frozen=True)
class Device:
    """The rates kernels.py prices work with; `calibrate` may replace any of them."""

    peak: float
    """Dense FLOP/s."""
    generation: str
    """``ampere`` or ``hopper``: which GEMM/attention constants apply."""
    hbm: float
    """Device memory bandwidth, bytes/s."""
    gemm_max: float
    """GEMM_MAX_EFFICIENCY of the generation, or a measured value."""
    attention_scale: float = 1.0
    """Multiplies the flash-attention efficiency (1: the published/measured table; a run's
    measured step time scales it with everything else, calibrate.py)."""

    @classmethod
    def of(cls, gpu: GPUSpec) -> "Device":
        gen = generation(gpu)
        hbm = HBM_GB_PER_S.get(gpu.name, gpu.peak_tflops * 1e3 / 300)
        return cls(peak=gpu.peak_tflops * 1e12, generation=gen, hbm=hbm * 1e9,
                   gemm_max=GEMM_MAX_EFFICIENCY[gen])


def generation(gpu: GPUSpec) -> str:
    """``ampere`` for A100-class parts, else ``hopper`` (the newer constants; a custom GPU spec
    or the CPU preset gets them too: their time predictions carry no published basis)."""
    return "ampere" if gpu.name.upper().startswith("A100") else "hopper"


def gemm_efficiency(dev: Device, m, n, k, batch=1):
    """Achieved share of peak of an (m×k)·(k×n) bf16 GEMM (``batch`` of them in one batched
    call, whose tiles share the waves), from a roofline.

    time = FLOPs / (peak · e_max · wave) + bytes / (HBM · GEMM_MEMORY_EFFICIENCY): wave is the
    busy share of the SMs over the GEMM's waves of output tiles (the better of GEMM_TILES), bytes
    its operands and output in bf16. Fitted on 176 GEMMs measured on an H200 (constants.py).
    """
    m, n, k = (np.asarray(x, dtype=float) for x in (m, n, k))
    sms = SM_COUNT[dev.generation]
    wave = 0.0
    for tm, tn in GEMM_TILES:
        tiles = np.ceil(m / tm) * np.ceil(n / tn) * batch
        wave = np.maximum(wave, tiles / (np.ceil(tiles / sms) * sms))
    flops = 2.0 * m * n * k
    t = flops / (dev.peak * dev.gemm_max * wave) + 2.0 * (m * k + k * n + m * n) / (
        dev.hbm * GEMM_MEMORY_EFFICIENCY)
    return flops / (t * dev.peak)


def gemm_ceiling_for(dev: Device, n: int, tflops: float) -> float:
    """The ``gemm_max`` at which `gemm_efficiency` of an n×n×n GEMM equals a measured rate
    (preflight's GEMM check), the roofline's memory side kept."""
    flops = 2.0 * n**3
    t_mem = 6.0 * n * n / (dev.hbm * GEMM_MEMORY_EFFICIENCY)
    t_math = flops / (tflops * 1e12) - t_mem
    if t_math <= 0:
        raise ValueError(f"{tflops:g} TFLOP/s at n={n} is faster than this GPU's memory allows")
    wave = float(gemm_efficiency(dataclasses.replace(dev, gemm_max=1.0, hbm=float("inf")), n, n, n))
    return flops / (dev.peak * wave * t_math)


def gemm_time(dev: Device, m, n, k, batch=1):
    """Seconds for a (batched) GEMM's forward and its two backward GEMMs (data and weight
    gradients)."""
    f = 2.0 * m * n * k * batch
    return (f / gemm_efficiency(dev, m, n, k, batch) + f / gemm_efficiency(dev, m, k, n, batch)
            + f / gemm_efficiency(dev, n, k, m, batch)) / dev.peak


def flash_efficiency(dev: Device, head_dim: int, seq_len: int) -> float:
    """Share of peak (planner's count: no causal halving) of flash attention forward + backward."""
    table = FLASH_ATTENTION[dev.generation]
    key = min(table, key=lambda d: abs(d - head_dim))
    e_inf, s_half = table[key]
    return dev.attention_scale * e_inf * seq_len / (seq_len + s_half)


@dataclass
class BlockTimes:
    """Seconds per micro-batch for one block on one rank (arrays over candidates)."""

    work: np.ndarray
    """Forward + backward of the block (model work)."""
    recompute: np.ndarray
    """What the layout's recompute mode repeats."""
    forward: np.ndarray
    """Forward alone (what the pipeline's per-chunk timing needs)."""


def block_times(model: ModelConfig, dev: Device, stack: StackProfile, tp, mb, sp,
                rec) -> BlockTimes:
    """Kernel time of one block per micro-batch on one TP rank."""
    tp, mb = np.asarray(tp, dtype=float), np.asarray(mb, dtype=float)
    s, h = model.seq_len, model.hidden
    tokens = s * mb
    kv = model.num_kv_heads * model.head_dim
    up = (2 if model.mlp == "swiglu" else 1) * model.ffn
    gemms = (gemm_time(dev, tokens, (h + 2 * kv) / tp, h) + gemm_time(dev, tokens, h, h / tp)
             + gemm_time(dev, tokens, up / tp, h) + gemm_time(dev, tokens, h, model.ffn / tp))
    gemm_fwd = gemms / 3  # each orientation does the same FLOPs; close enough for the forward
    attn, attn_fwd = attention_time(model, dev, stack, tp, mb)
    mem = memory_bound_time(model, dev, stack, tp, mb, sp)
    work = gemms + attn + mem
    forward = gemm_fwd + attn_fwd + FWD_SHARE_MEMORY * mem
    rec = np.asarray(rec)
    recompute = np.select([rec == 2, rec == 1], [forward, attn_fwd], 0.0)
    return BlockTimes(work=work, recompute=recompute, forward=forward)


def attention_time(model: ModelConfig, dev: Device, stack: StackProfile, tp, mb):
    """(forward + backward, forward) seconds of the attention core per micro-batch per rank."""
    s, h = model.seq_len, model.hidden
    counted = 4.0 * s * s * h * mb / tp  # QKᵀ and A·V forward, the planner's FLOP count
    if stack.flash_attention:
        t = 3 * counted / (dev.peak * flash_efficiency(dev, model.head_dim, s))
        return t, t / 3
    heads = model.heads * mb / tp  # batched GEMMs per head: QKᵀ (s×d·d×s), A·V (s×s·s×d)
    d = model.head_dim
    gemm = gemm_time(dev, s, s, d, heads) + gemm_time(dev, s, d, s, heads)
    scores = heads * s * s
    soft = scores * SOFTMAX_BYTES_PER_SCORE / (dev.hbm * MEMORY_BOUND_EFFICIENCY["elementwise"])
    return gemm + soft, gemm / 3 + soft / 2


def memory_bound_time(model: ModelConfig, dev: Device, stack: StackProfile, tp, mb, sp):
    """Forward + backward seconds of a block's memory-bound kernels per micro-batch per rank.

    Bytes per token (bf16; forward + backward): each of the two norms 10·h (read x, write y;
    read x and dy, write dx), each residual add (with dropout where the model has it) 12·h, the
    activation 10·f (GeLU) or 16·f (SwiGLU: two inputs), rotary 8·(q + k width). Norms and
    residual work are divided by TP only under sequence parallelism.
    """
    tp, mb = np.asarray(tp, dtype=float), np.asarray(mb, dtype=float)
    tokens = model.seq_len * mb
    h, f = model.hidden, model.ffn
    split = np.where(np.asarray(sp, dtype=bool) & (tp > 1), tp, 1.0)
    norms = (1 if model.parallel_block else 2)
    norm_eff = MEMORY_BOUND_EFFICIENCY["elementwise" if stack.fused_norms else "norm"]
    bw = dev.hbm
    t_norm = norms * 10 * h * tokens / split / (bw * norm_eff)
    t_res = 2 * 12 * h * tokens / split / (bw * MEMORY_BOUND_EFFICIENCY["elementwise"])
    act = (16 if model.mlp == "swiglu" else 10) * f * tokens / tp
    t_act = act / (bw * MEMORY_BOUND_EFFICIENCY["activation"])
    rope = 8 * (h + model.num_kv_heads * model.head_dim) * tokens / tp
    t_rope = rope / (bw * MEMORY_BOUND_EFFICIENCY["elementwise"])
    return t_norm + t_res + t_act + t_rope


def head_time(model: ModelConfig, dev: Device, tp, mb):
    """Forward + backward seconds of the output projection and the loss per micro-batch: the
    logits GEMM, and ~16 bytes per logit (bf16 written, fp32 softmax read and written, the
    gradient written) at element-wise bandwidth."""
    tp, mb = np.asarray(tp, dtype=float), np.asarray(mb, dtype=float)
    tokens = model.seq_len * mb
    logits = tokens * model.vocab / tp
    return (gemm_time(dev, tokens, model.vocab / tp, model.hidden)
            + 16 * logits / (dev.hbm * MEMORY_BOUND_EFFICIENCY["elementwise"]))
