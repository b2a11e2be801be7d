"""The split of the model over pipeline stages: which blocks each rank's chunks hold.

`LayoutConfig.layers_per_stage` gives pp·vpp block counts in pipeline order (uneven splits
allowed). Virtual stage k holds the next counts[k] blocks; rank r runs virtual stages
r, r+pp, r+2pp, … (Megatron's interleaved assignment), the first carrying the embedding and the
last the head and loss; those two may hold no block at all (`config.layout.split_problem`).
Blocks keep their global indices, so parameter names, initial values and checkpoints are the
same at every layout.

This module says what each chunk holds, as data (`ChunkSpec`); `parallel.parallelize.build_chunks`
turns that into modules (plain `Transformer` stages, parallelized).
"""

from __future__ import annotations

from dataclasses import dataclass

from mscale.config.layout import split_problem
from mscale.errors import MscaleError
from mscale.parallel.pipeline.schedule import check_micro_batches, virtual_stage


def stage_layer_ids(counts: list[int]) -> list[list[int]]:
    """Global block indices of every virtual stage, in pipeline order."""
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_pipeline(plan) -> None:
    """Refuse a plan the pipeline cannot run, naming the field and the fix. `check_layout`
    refuses the same plans; this is the engine's own guard for plans that bypassed it."""
    layout, model = plan.layout, plan.model
    reason = check_micro_batches(layout.pp, layout.vpp, layout.micro_batches(plan.training.global_batch))
    if reason:
        raise MscaleError(reason, field="layout.micro_batch",
                          fix="raise global_batch or lower micro_batch so that "
                              "global_batch/(dp·micro_batch) >= pp (a multiple of pp with vpp > 1)")
    counts = layout.layers_per_stage(model.layers)
    stages = layout.pp * layout.vpp
    problem = (f"{len(counts)} counts for pp·vpp={stages} stages" if len(counts) != stages
               else split_problem(counts, model.layers))
    if problem:
        raise MscaleError(f"stage split: {problem}", field="layout.stage_layers",
                          fix="give pp·vpp counts summing to model.layers, >= 1 for every middle "
                              "stage, or drop stage_layers")
    if model.tie_embeddings:
        raise MscaleError("tied embeddings are not supported with pipeline parallelism (the "
                          "embedding and the head live on different stages)",
                          field="model.tie_embeddings", fix="set tie_embeddings: false or pp: 1")


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk of a rank: its global block indices, and whether it carries the embedding
    (first virtual stage) and the head and loss (last virtual stage)."""

    layer_ids: tuple[int, ...]
    has_embedding: bool
    has_head: bool


def rank_chunks(plan, pp_rank: int) -> list[ChunkSpec]:
    """What the chunks of pipeline rank ``pp_rank`` hold, one per virtual stage it runs; without
    pipelining, one chunk with the whole model. A plan the pipeline cannot run is refused."""
    layout = plan.layout
    if layout.pp == 1:
        return [ChunkSpec(tuple(range(plan.model.layers)), True, True)]
    check_pipeline(plan)
    pp, stages = layout.pp, layout.pp * layout.vpp
    ids = stage_layer_ids(layout.layers_per_stage(plan.model.layers))
    specs = []
    for chunk in range(layout.vpp):
        vs = virtual_stage(pp_rank, chunk, pp)
        specs.append(ChunkSpec(tuple(ids[vs]), has_embedding=vs == 0, has_head=vs == stages - 1))
    return specs
