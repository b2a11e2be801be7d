"""Every constant of the cost model, in one place, each with where it comes from.

Three kinds: published facts (docs/references.md and the papers it cites), values calibrated
against published measurements (the calibration is a test: tests/unit/planner/test_cost.py),
and engineering assumptions, labelled as such. docs/plan.md repeats this table for users.
"""

from __future__ import annotations

# --- compute ----------------------------------------------------------------------------------
COMPUTE_EFFICIENCY = 0.655
"""Share of the dense peak that the transformer's kernels reach while computing (GEMMs, flash
attention, element-wise ops together). Calibrated: with the overlaps below, MegaScale's layout (TP 8,
PP 8, v 6, micro-batch 1, ZeRO-2, batch 6144) reproduces the
paper's 175B strong-scaling MFU (arXiv 2402.15627, §6.1 Table 2: 59.1/57.3/54.9/55.2% on
3,072/6,144/8,192/12,288 A100s) within 1.5 points (worst −1.1 at 12,288; it was +1.2 at 8,192 before
the pipeline's critical-path transfers were charged, which moved every point by −0.1 to −0.2, so no
re-fit). Utilization lost to it is shown as "kernels"."""

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
CHECKPOINT_BYTES_PER_PARAM = 14
"""A resumable checkpoint: bf16 weights + fp32 master + Adam m + v (docs/references.md: 175B → ~2.45 TB)."""

# --- memory -----------------------------------------------------------------------------------
MEMORY_USABLE_FRACTION = 0.90
"""Share of device memory the planner lets a layout use. Assumption: CUDA context, NCCL buffers
and allocator fragmentation take the rest (typically several GB on an 80 GB device)."""
LOGITS_BYTES = 4
"""Bytes per logit kept for the loss on the last stage (fp32 softmax/cross-entropy)."""

# --- communication ----------------------------------------------------------------------------
LINK_EFFICIENCY = 0.80
"""Bus bandwidth reached by a large collective as a share of the link's line rate. Assumption
(nccl-tests on NVLink and InfiniBand typically reach 75-90% of line rate for large messages)."""
HOP_LATENCY_S = 5e-6
"""Latency per ring step. Assumption; only matters for small messages and very large rings."""
TP_OVERLAP = 0.5
"""Share of tensor/sequence-parallel communication hidden behind GEMMs. MegaScale fuses the
all-gather/reduce-scatter with the adjacent GEMMs (§3.2; +2.2 MFU points in its Table 3 ablation).
Calibrated together with COMPUTE_EFFICIENCY."""
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
"""Time from a failure to training again, before loading: MegaScale §6.3 reports detection and
diagnosis in under 10 minutes."""
SNAPSHOT_GB_PER_S = 20.0
"""Device → pinned host copy per GPU, the blocking part of a two-stage checkpoint (MegaScale §4.3).
Assumption: a PCIe Gen4 x16 link (~25 GB/s) at ~80%."""
STORAGE_WRITE_GB_PER_S = 273.0
"""Aggregate checkpoint write bandwidth: Narayanan et al. (arXiv 2104.04473, §5.10) measured
273 GB/s saving to Selene's all-NVMe filesystem. Override with --ckpt-write-gbps."""
STORAGE_READ_GB_PER_S = 1000.0
"""Aggregate checkpoint read bandwidth: the same paper measured a 1 TB/s peak when loading."""

# --- search -----------------------------------------------------------------------------------
MAX_MICRO_BATCH = 16
"""Largest micro-batch tried: Narayanan et al. (Fig. 7) saw throughput saturate by b≈4-8."""
MAX_SKELETONS = 50_000
"""Most (tp, pp, vpp, micro-batch) combinations one search enumerates before it refuses with
advice to narrow it. GPT-175B on 12,288 GPUs needs a few hundred; each combination is costed under
up to 36 option sets, so the bound keeps a search within seconds and a few hundred MB."""
