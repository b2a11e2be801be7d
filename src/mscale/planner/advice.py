"""When no layout fits: compute what would make one fit, instead of a generic hint.

Tried in order, each a real search: lifting the training config's restrictions (recompute, ZeRO,
micro-batch), then more nodes (×2 up to ×16, keeping the global batch).
"""

from __future__ import annotations

from mscale.config.cluster import MAX_GPUS, ClusterConfig
from mscale.errors import MscaleError
from mscale.planner.cost import Problem
from mscale.planner.search import SearchResult, describe, search

RESTRICTED = ("recompute", "zero_stage", "micro_batch")


def device_word(pb: Problem) -> str:
    """What one rank runs on, for messages: a CPU cluster (``gpu: cpu``) has no GPU, and its
    memory budget is per process."""
    return "process" if pb.cluster.gpu.name.lower() == "cpu" else "GPU"


def no_fit_error(pb: Problem, result: SearchResult, files: dict[str, str]) -> MscaleError:
    """An MscaleError saying why nothing fits and which computed change makes something fit."""
    budget = pb.budget_bytes / 1e9
    if result.closest is None:  # no structurally valid layout at all
        reasons = "; ".join(f"{r} ({n} layout{'s' if n > 1 else ''}, e.g. {ex})"
                            for r, n, ex in result.rejects.rows()[:3])
        mb = pb.training.micro_batch
        per = f"GPU count × micro_batch = {pb.cluster.world_size * mb}" if mb else "GPU count"
        return MscaleError(f"no valid layout for {pb.cluster.world_size} GPUs: {reasons}",
                           file=files.get("training"), field="global_batch",
                           fix=f"make global_batch a multiple of dp·micro_batch for some dp "
                               f"dividing the GPUs (e.g. a multiple of the {per})"
                               + (", or drop micro_batch" if mb else "")
                               + ", or change the node count")
    lo = result.layout(result.closest)
    need = result.cost(result.closest).mem_total / 1e9
    fixes = []
    set_fields = [f for f in RESTRICTED if getattr(pb.training, f) is not None]
    if set_fields:
        free = pb.training.model_copy(update={f: None for f in set_fields})
        r = _search_or_none(Problem(pb.model, free, pb.cluster))
        if r is not None and r.count:
            best = r.layout(0)
            fixes.append(f"drop {', '.join(f'training.{f}' for f in set_fields)} from the training "
                         f"config: then {describe(best)} fits ({r.cost(0).mem_total / 1e9:.1f} GB)")
    for factor in (2, 4, 8, 16):
        if pb.cluster.world_size * factor > MAX_GPUS:
            break
        bigger = pb.cluster.model_copy(update={"nodes": pb.cluster.num_nodes * factor,
                                               "hostlist": None})
        bigger = ClusterConfig.model_validate(bigger.model_dump())
        r = _search_or_none(Problem(pb.model, pb.training, bigger))
        if r is None:
            break
        if r.count:
            fixes.append(f"use {bigger.num_nodes} nodes ({bigger.world_size} GPUs): then "
                         f"{describe(r.layout(0))} fits ({r.cost(0).mem_total / 1e9:.1f} GB)")
            break
    if not fixes:
        fixes.append("a smaller model or sequence length" if device_word(pb) == "process"
                     else "a GPU with more memory, or a smaller model or sequence length")
    return MscaleError(f"{pb.model.name} fits no layout on {pb.cluster.world_size} "
                       f"{pb.cluster.gpu.name}: the least memory any layout needs is {need:.1f} GB "
                       f"per {device_word(pb)} ({describe(lo)}) against {budget:.1f} GB usable",
                       file=files.get("model"), field=None, fix="; or ".join(fixes))


def _search_or_none(pb: Problem) -> SearchResult | None:
    """A search for advice; None when that search would be too large to run."""
    try:
        return search(pb)
    except MscaleError:
        return None
