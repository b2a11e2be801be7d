"""Per-step metrics: every rank's timings and loss gathered to rank 0 with one collective.

At 12,288 ranks one file per rank per step would be a denial of service on a shared filesystem,
so ranks send a few floats to rank 0, which writes one JSONL record (docs/architecture.md). From
`COMPACT_MIN_RANKS` ranks on, the record is schema version 2: its per-rank vectors are written as
zstd-compressed microseconds (config/vectors.py), ~10x fewer bytes a step than JSON text
(10.2x at 12,288 ranks: docs/benchmarks.md, "watch"); smaller runs keep the plain lists of
version 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mscale.config.records import MetricsRecord, metrics_version_for

# Layout of the vector each rank contributes.
TIMINGS = ("step", "compute", "comm_wait", "data", "bubble", "comm_tp", "comm_pp", "comm_dp")
"""The step timer's entries each rank sends (train/timers.py)."""
FIELDS = (*TIMINGS, "loss", "loss_weight")


def gather_rank_vectors(timings: dict[str, float], loss: torch.Tensor | float | None,
                        world: int) -> torch.Tensor | None:
    """Gather [world, len(FIELDS)] on rank 0 (None elsewhere).

    ``loss`` is this rank's mean loss if it computed one (last pipeline stage, TP rank 0), else
    None; rank 0 averages the contributed losses with weight 1 each, which is the mean over DP
    replicas of equal-sized shards. A device tensor is read here, once per step: the only point
    where the host waits for the loss (after the step timer's synchronize, so at no extra cost).
    """
    value = 0.0 if loss is None else float(loss)
    row = torch.tensor([*(timings[name] for name in TIMINGS), value,
                        0.0 if loss is None else 1.0], dtype=torch.float64)
    if not dist.is_initialized() or world == 1:
        return row.unsqueeze(0)
    if dist.get_rank() != 0:
        dist.gather(row, None, dst=0)
        return None
    matrix, rows = _receive_buffer(world)
    dist.gather(row, rows, dst=0)
    return matrix.clone()  # the caller keeps it; the buffer is the next step's


_BUFFERS: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}


def _receive_buffer(world: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Rank 0's [world, len(FIELDS)] receive matrix and its rows, made once: building 12,288
    row tensors and stacking them took ~35 ms a step on rank 0, on every step's critical path
    (every rank then waits in the control all-reduce)."""
    if world not in _BUFFERS:
        matrix = torch.empty(world, len(FIELDS), dtype=torch.float64)
        _BUFFERS[world] = matrix, list(matrix.unbind(0))
    return _BUFFERS[world]


def build_record(vectors: torch.Tensor, *, step: int, grad_norm: float, clip_threshold: float,
                 lr: float, tokens: int, flops_per_step: float | None, peak_flops_per_device: float,
                 extra: dict | None = None) -> MetricsRecord:
    """Turn the gathered matrix into one metrics record (rank 0 only)."""
    cols = {name: vectors[:, i].tolist() for i, name in enumerate(FIELDS)}
    weight = sum(cols["loss_weight"])
    loss = sum(cols["loss"]) / weight if weight else math.nan
    step_time = max(cols["step"])  # synchronous training: the step ends when the last rank ends
    mfu = None
    if flops_per_step and step_time > 0:
        mfu = flops_per_step / step_time / (peak_flops_per_device * len(cols["step"]))
    return MetricsRecord(
        schema_version=metrics_version_for(len(cols["step"])), step=step, loss=loss, grad_norm=grad_norm, clip_threshold=clip_threshold, lr=lr,
        tokens=tokens, tokens_per_s=tokens / step_time if step_time > 0 else 0.0, mfu=mfu,
        step_time=cols["step"], compute_time=cols["compute"], comm_wait=cols["comm_wait"],
        data_time=cols["data"], bubble_time=cols["bubble"], comm_tp=cols["comm_tp"],
        comm_pp=cols["comm_pp"], comm_dp=cols["comm_dp"], extra=extra or {})
