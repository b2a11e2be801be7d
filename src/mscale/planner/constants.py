"""Every constant of the cost model, in one place, each with where it comes from.

Three kinds: published facts (docs/references.md and the papers it cites), values calibrated
against published measurements (the calibration is a test: tests/unit/planner/test_cost.py),
and engineering assumptions, labelled as such. docs/plan.md repeats this table for users.
"""

from __future__ import annotations

# --- compute ----------------------------------------------------------------------------------
GEMM_MAX_EFFICIENCY = {"ampere": 0.825, "hopper": 0.75}
"""Share of the dense peak a bf16 GEMM's math reaches once its operands stream at full rate (the
compute ceiling of kernels.gemm_efficiency's roofline). hopper: measured, cuBLAS through torch
2.11 / CUDA 13.0 on one H200 (bench/gpu_kernels.py, bench/data/h200_kernels.json, 2026-11): 176
block GEMMs of hidden 2048-12288, tp 1-8, 2048 and 8192 tokens, forward and weight-gradient
orientations, fitted with GEMM_MEMORY_EFFICIENCY and the wave model (median |error| 3.4%).
ampere: fitted on one published source only, MegaScale Table 2 (175B, batch 6144;
tests/unit/planner/test_cost.py), every other constant fixed, minimising the largest error in MFU
points."""
GEMM_MEMORY_EFFICIENCY = 0.70
"""Share of HBM bandwidth at which a GEMM's operands and output move (2·(m·k + k·n + m·n) bytes),
the memory side of the roofline, added to the math time: a GEMM with a short reduction or a thin
output is bandwidth-bound (k below the GPU's FLOP/byte ridge: ~150 on A100, ~200 on H200, ~300 on
H100). Fitted with GEMM_MAX_EFFICIENCY["hopper"] on the H200 measurements; applied to every GPU
with its own bandwidth."""
GEMM_TILES = ((128, 256), (256, 128))
"""Output tiles one SM computes at a time (cuBLAS's most efficient tiles, NVIDIA Matrix
Multiplication Background User's Guide §2.3); a GEMM runs in waves of one tile per SM, and the
last partial wave idles the rest (ibid. §3.2, wave quantization). The better of the two is used."""
SM_COUNT = {"ampere": 108, "hopper": 132}
"""Streaming multiprocessors: A100 108, H100/H800/H200 SXM 132 (NVIDIA A100 and H100 whitepapers;
132 confirmed by torch on the H200 above)."""

FLASH_ATTENTION = {
    "hopper": {64: (0.816, 1361.0), 128: (1.06, 1555.0)},
    "ampere": {64: (1.00, 1361.0), 128: (1.24, 1555.0)},
}
"""Attention core forward + backward, flash kernels, causal: (e_inf, s_half) with achieved share
of peak e = e_inf·s/(s + s_half), in FLOPs as the planner counts them (4·s²·h per sequence forward,
no causal halving, so e may exceed 1: a causal kernel does half that work). hopper: measured on
the H200 above (torch SDPA, bf16, heads·d = 2048, 16k tokens per call, s = 1k-8k; fitted on 1/e
against 1/s; d 64 at 8k: 0.70, d 128 at 8k: 0.89). ampere: FlashAttention-2 reaches 50-73% of
the A100's peak (Dao, arXiv 2307.08691, abstract and §4.1) in real FLOPs, i.e. 1.0-1.46 in this
count; e_inf set to 0.50·2 (d 64) and 0.62·2 (d 128), with Hopper's s_half: an assumption inside
the published range. Head dims other than 64 and 128 use the nearer entry."""

MEMORY_BOUND_EFFICIENCY = {"elementwise": 0.75, "activation": 0.53, "norm": 0.25}
"""Share of HBM bandwidth memory-bound kernels reach, by kind, counting the bytes each must read
and write. Measured on the H200 above (torch eager, bf16, 8192 tokens × hidden 4096/12288):
add 3.3-3.9 TB/s of 4.8 (0.69-0.82), GELU 2.3-2.8 (0.48-0.58), layer norm forward + backward
1.06-1.33 (0.22-0.28). Stacks with fused norm kernels (stacks.StackProfile.fused_norms) run norms
at the element-wise rate: an assumption (apex/Transformer Engine fused norms are single-pass)."""
HBM_GB_PER_S = {"A100": 2039.0, "A100-40GB": 1555.0, "H100": 3350.0, "H800": 3350.0,
                "H200": 4800.0, "cpu": 25.6}
"""Device memory bandwidth, GB/s, for presets that do not state it (docs/references.md: H100
3.35 TB/s, H200 4.8 TB/s; NVIDIA A100 datasheet: 2,039 GB/s for 80 GB SXM, 1,555 for 40 GB).
``cpu``: one DDR4-3200 channel, 3,200 MT/s × 8 bytes, a process's share of a server's memory.
Without an entry a preset gets peak / 300 FLOP per byte (a GPU's ratio), 0.67 GB/s for the cpu
preset: a roofline under which no CPU GEMM preflight measured could run, so `plan --calibrate`
refused every CPU cluster's preflight report."""
SOFTMAX_BYTES_PER_SCORE = 22
"""Unfused attention (no flash kernel): bytes moved per attention-score element per forward +
backward, bf16: the QKᵀ output written (2), fused scale-mask-softmax read and written (4), dropout
read, written and its 1-byte mask (5); backward: dropout (5) and softmax (6) gradients. Counted
from Megatron-LM's kernels (fused_softmax, dropout), and confirmed on the H200 above
(bench/gpu_kernels.py --only-unfused, s 2048, head dim 96/128: the time an unfused attention
spends beyond its two batched GEMMs moves 22.0-22.6 bytes per score at the element-wise rate)."""

# --- bytes ------------------------------------------------------------------------------------
ACT_BYTES = 2
"""Bytes per activation element in bf16 (Korthikanti et al., arXiv 2205.05198, §4: the 34 and 5as/h
coefficients already assume 2-byte activations and 1-byte dropout masks)."""
STATE_BYTES = {
    # docs/references.md "Memory per GPU": bf16 weight 2 B, fp32 main grad 4 B, fp32 master + Adam m + v 12 B.
    "bf16": {"weight": 2, "grad": 4, "optimizer": 12},
    # fp32 training keeps no separate master copy: weight 4, grad 4, Adam m + v 8.
    "fp32": {"weight": 4, "grad": 4, "optimizer": 8},
}
GRAD_REDUCE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per gradient element on the wire for the data-parallel reduction: bf16 runs reduce bf16
gradients (Megatron-LM's default without --accumulate-allreduce-grads-in-fp32), fp32 runs fp32."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A resumable checkpoint as this engine writes it: fp32 master + Adam m + v; the parameters are
fp32 and equal the master after every step, so they are not stored again (ckpt/ownership.py,
docs/ckpt.md). A stack that stores bf16 weights beside them writes 14 (docs/references.md: 175B
→ ~2.45 TB); this engine 175B → ~2.1 TB."""

# --- memory -----------------------------------------------------------------------------------
MEMORY_USABLE_FRACTION = 0.90
"""Share of device memory the planner lets a layout use. Assumption: CUDA context, NCCL buffers
and allocator fragmentation take the rest (typically several GB on an 80 GB device)."""

# --- communication ----------------------------------------------------------------------------
LINK_EFFICIENCY = 0.80
"""Bus bandwidth reached by a large collective as a share of the link's line rate. Assumption
(nccl-tests on NVLink and InfiniBand typically reach 75-90% of line rate for large messages)."""
HOP_LATENCY_S = 5e-6
"""Latency per ring step. Assumption; only matters for small messages and very large rings."""
P2P_LATENCY_S = 20e-6
"""Fixed cost of one pipeline send/recv pair: launching the NCCL p2p kernels, the rendezvous with
the peer and the completion wait, paid by every transfer whatever its size (deep interleaving
multiplies the transfers by v). Assumption: nccl-tests sendrecv small-message latency across
InfiniBand is of the order of 10-20 µs, plus the host-side launch of the batched isend/irecv."""
TP_OVERLAP = 0.5
"""Share of tensor/sequence-parallel communication hidden behind GEMMs. MegaScale fuses the
all-gather/reduce-scatter with the adjacent GEMMs (§3.2; +2.2 MFU points in its Table 3 ablation).
Calibrated together with the Ampere GEMM ceiling (GEMM_MAX_EFFICIENCY)."""
PP_OVERLAP = 0.9
"""Share of an overlappable pipeline send/recv hidden behind compute (MegaScale §3.2 decouples send
and receive so they overlap). Assumption; it applies only off the critical path: the 2·(p·v − 1)
transfers of the fill and drain of an interleaved schedule (nearly all of them under plain 1F1B)
are never hidden (comm.pp_critical_transfers, derived from the schedule itself)."""

# --- goodput ----------------------------------------------------------------------------------
FAILURES_PER_1000_NODE_DAYS = 3.79
"""Default failure rate. Llama 3 (arXiv 2407.21783, §3.3.4): 419 unexpected interruptions in 54 days
on 16,384 H100s = 2,048 nodes → 419 / (54 · 2048) · 1000 = 3.79, between the 2.34 and 6.50 that
Kokolis et al. (arXiv 2410.21680) measured on two A100 clusters."""
RESTART_S = 600.0
"""Time from a failure to training again, before loading: MegaScale §6.3 reports detecting a
failure and running the diagnostic tests in under 10 minutes on average; taking that as the whole
time to training again, relaunch included, is an assumption."""
SNAPSHOT_GB_PER_S = 20.0
"""Device → pinned host copy per GPU, the blocking part of a two-stage checkpoint (MegaScale §4.4).
Assumption: a PCIe Gen4 x16 link (~25 GB/s) at ~80%."""
STORAGE_WRITE_GB_PER_S = 273.0
"""Aggregate checkpoint write bandwidth: Narayanan et al. (arXiv 2104.04473, §5.10) measured
273 GB/s saving to Selene's all-NVMe filesystem. Override with --ckpt-write-gbps."""
STORAGE_READ_GB_PER_S = 1000.0
"""Aggregate checkpoint read bandwidth: the same paper measured a 1 TB/s peak when loading."""

MODEL_ERROR = 0.04
"""Relative step-time difference below which the search does not trust its own ranking and puts
the simpler layout first (search._prefer_simpler). The fitted model reproduces MegaScale's four
batch-6144 rows with relative residuals from −1.9% to +1.8% (a 3.7% spread between layouts that
differ only in DP size); held-out published rows are off by a median 3.7% (the 30 rows of the
held-out sources; 4.4% over all 35 held-out rows: docs/plan.md, "Predictions against published
measurements"), much of it common to every layout of a run. 4% is that spread, rounded up: two
layouts closer than this are a tie for the model."""

# --- search -----------------------------------------------------------------------------------
MAX_MICRO_BATCH = 16
"""Largest micro-batch tried: Narayanan et al. (Fig. 7) saw throughput saturate by b≈4-8."""
MAX_SKELETONS = 50_000
"""Most (tp, pp, vpp, micro-batch) combinations one search enumerates before it refuses with
advice to narrow it. GPT-175B on 12,288 GPUs needs a few hundred; each combination is costed under
up to 36 option sets, so the bound keeps a search within seconds and a few hundred MB."""
