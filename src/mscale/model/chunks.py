"""The model chunks one rank runs, built from the pipeline split.

`parallel.pipeline.stages.rank_chunks` decides which blocks, embedding and head each chunk holds;
this module builds those `Transformer`s. It lives in model/, not parallel/, because the model is
the layer above: it is written against parallel's tensor-parallel layers, so parallel importing
the model would make a cycle (docs/architecture.md, "Layers"). The training engine and the
checkpoint's offline layout (`ckpt.ownership`, on the meta device) both call it, so they cannot
disagree on what a rank holds.
"""

from __future__ import annotations

import torch

from mscale.model.transformer import Transformer
from mscale.parallel.pipeline.stages import rank_chunks
from mscale.parallel.tensor import TensorParallel


def build_chunks(plan, pp_rank: int, tp: TensorParallel,
                 device: torch.device) -> list[Transformer]:
    """The chunks of pipeline rank ``pp_rank`` (the whole model without pipelining), uninitialised,
    on ``device``; callers initialise them by global name (`init_parameters`)."""
    return [Transformer(plan.model, tp, layer_ids=list(spec.layer_ids),
                        has_embedding=spec.has_embedding, has_head=spec.has_head,
                        recompute=plan.layout.recompute).to(device)
            for spec in rank_chunks(plan, pp_rank)]
