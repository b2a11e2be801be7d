"""Forward passes only, through the pipeline: held-out (eval) loss.

No backward means no 1F1B: every rank runs its (micro-batch, chunk) pairs in lexicographic
order (`posting.forward_only_actions`), waiting for the activation from the previous virtual
stage. What it posts is `posting.forward_only_plan`, walked by `p2p.PlanWalker` as in training:
the receive of the first forward, then after each forward one batch with its output's send and
the next forward's receive. Each wait is on a pair earlier in the global order (micro, chunk,
rank), so the ranks cannot hang, and each link carries its messages in the order its receiver
asks for them; `posting.replay_nccl` proves both under NCCL's rules (one stream per
communicator, order matching). Nothing overlaps: evaluation runs every few hundred steps on a few
batches, and this order keeps no activation alive beyond its send.
"""

from __future__ import annotations

from typing import Callable

import torch

from mscale.distributed.init import to_device
from mscale.parallel.pipeline.p2p import PlanWalker
from mscale.parallel.pipeline.posting import forward_only_actions, forward_only_plan
from mscale.parallel.pipeline.runner import PipelineStage
from mscale.parallel.pipeline.schedule import needs, produces, virtual_stage


def run_pipeline_forward(stage: PipelineStage,
                         get_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                         micro_batches: int) -> torch.Tensor | None:
    """Sum of the micro-batch losses on the rank holding the last virtual stage (float64, on the
    device), None elsewhere. ``get_batch(micro)`` gives (tokens, labels) on the host."""
    pp, vpp, rank = stage.pp, stage.vpp, stage.pp_rank
    actions = forward_only_actions(pp, vpp, micro_batches, rank)
    posting = PlanWalker(stage.link, forward_only_plan(pp, vpp, micro_batches, rank))
    last = pp * vpp - 1
    total = None
    with torch.no_grad(), stage.precision.cast_scope():
        posting.post_next()
        batch = None
        for k, a in enumerate(actions):
            vs = virtual_stage(rank, a.chunk, pp)
            if a.chunk == 0:
                batch = None  # a new micro-batch
            if vs == 0 or vs == last:
                batch = batch or tuple(to_device(t, stage.device) for t in get_batch(a.micro))
            need = needs(a, rank, pp, vpp)
            x = batch[0] if need is None else posting.wait(need)
            with stage.precision.autocast():
                out = stage.chunks[a.chunk](x, batch[1]) if vs == last else stage.chunks[a.chunk](x)
            if vs == last:
                value = out.detach().double()
                total = value if total is None else total + value
            posting.post_next(produces(a, rank, pp, vpp), out)
        posting.finish()
    return total
