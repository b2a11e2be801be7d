"""Small wrappers over torch.distributed collectives that differ between torch versions."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor variants (the old names still work but warn on every call).
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None)
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                    async_op: bool = False):
    """Concatenate every member's ``inp`` along dim 0 into ``out``."""
    if _ALL_GATHER_SINGLE is not None:
        return _ALL_GATHER_SINGLE(out, inp, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                        async_op: bool = False):
    """Sum ``inp`` over members and give member i the i-th chunk (dim 0) in ``out``."""
    if _REDUCE_SCATTER_SINGLE is not None:
        return _REDUCE_SCATTER_SINGLE(out, inp, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(out, inp, group=group, async_op=async_op)
