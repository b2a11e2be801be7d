"""Forward passes only, through the pipeline: held-out (eval) loss.

No backward means no 1F1B: every rank runs its (micro-batch, chunk) pairs in lexicographic
order, waiting for the activation from the previous virtual stage and leaving its output in
flight to the next. Each wait is on a pair earlier in the global order (micro, chunk, rank), so
the ranks cannot deadlock, and each link carries its messages in the order its receiver asks for
them (the pairing that NCCL's order matching needs). Nothing overlaps: evaluation runs every few
hundred steps on a few batches, and this order keeps no activation alive beyond its send.
"""

from __future__ import annotations

from typing import Callable

import torch

from mscale.distributed.init import to_device
from mscale.parallel.pipeline.runner import PipelineStage
from mscale.parallel.pipeline.schedule import Message, virtual_stage


def run_pipeline_forward(stage: PipelineStage,
                         get_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                         micro_batches: int) -> torch.Tensor | None:
    """Sum of the micro-batch losses on the rank holding the last virtual stage (float64, on the
    device), None elsewhere. ``get_batch(micro)`` gives (tokens, labels) on the host."""
    pp, vpp, rank, link = stage.pp, stage.vpp, stage.pp_rank, stage.link
    last = pp * vpp - 1
    total = None
    with torch.no_grad(), stage.precision.cast_scope():
        for micro in range(micro_batches):
            batch = None
            for chunk in range(vpp):
                vs = virtual_stage(rank, chunk, pp)
                if vs == 0 or vs == last:
                    batch = batch or tuple(to_device(t, stage.device) for t in get_batch(micro))
                x = batch[0] if vs == 0 else link.wait(Message("act", micro, vs - 1, vs))
                with stage.precision.autocast():
                    out = stage.chunks[chunk](x, batch[1]) if vs == last else stage.chunks[chunk](x)
                if vs == last:
                    value = out.detach().double()
                    total = value if total is None else total + value
                else:
                    link.post([(Message("act", micro, vs, vs + 1), out)], [])
                link.reap()
        link.drain()
    return total
