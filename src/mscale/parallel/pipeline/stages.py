"""The split of the model over pipeline stages: which blocks each rank's chunks hold.

`LayoutConfig.layers_per_stage` gives pp·vpp block counts in pipeline order (uneven splits
allowed). Virtual stage k holds the next counts[k] blocks; rank r runs virtual stages
r, r+pp, r+2pp, … (Megatron's interleaved assignment), the first carrying the embedding and the
last the head and loss. Blocks keep their global indices, so parameter names, initial values and
checkpoints are the same at every layout.
"""

from __future__ import annotations

import torch

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
    if len(counts) != layout.pp * layout.vpp or sum(counts) != model.layers or min(counts) < 1:
        raise MscaleError(f"stage split {counts} does not give each of pp·vpp="
                          f"{layout.pp * layout.vpp} stages >=1 of {model.layers} blocks",
                          field="layout.stage_layers", fix="give pp·vpp positive counts summing "
                          "to model.layers, or drop stage_layers")
    if model.tie_embeddings:
        raise MscaleError("tied embeddings are not supported with pipeline parallelism (the "
                          "embedding and the head live on different stages)",
                          field="model.tie_embeddings", fix="set tie_embeddings: false or pp: 1")


def build_stage_chunks(plan, groups, tp, device: torch.device) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage it runs), uninitialised, on ``device``.

    The engine initialises them by global name (`init_parameters`) afterwards.
    """
    from mscale.model import Transformer

    check_pipeline(plan)
    layout = plan.layout
    pp, stages = layout.pp, layout.pp * layout.vpp
    ids = stage_layer_ids(layout.layers_per_stage(plan.model.layers))
    chunks = []
    for chunk in range(layout.vpp):
        vs = virtual_stage(groups.pp_rank, chunk, pp)
        chunks.append(Transformer(plan.model, tp, layer_ids=ids[vs], has_embedding=vs == 0,
                                  has_head=vs == stages - 1, recompute=layout.recompute).to(device))
    return chunks
