"""The collectives of tensor and sequence parallelism, as autograd functions.

Megatron-style: every communication is an explicit call on the TP process group, paired with its
adjoint in backward, so a reader can count the collectives of a block by reading its forward.
Activations are sequence-first, ``[s, b, h]``: a sequence-parallel shard is then a contiguous
block of dim 0, which is exactly what ``all_gather_into`` / ``reduce_scatter_into`` move.

| function                | forward                    | backward                 |
|-------------------------|----------------------------|--------------------------|
| `copy_to_tp`            | identity                   | all-reduce               |
| `reduce_from_tp`        | all-reduce                 | identity                 |
| `scatter_to_sp`         | keep own sequence chunk    | all-gather               |
| `gather_from_sp`        | all-gather (sequence)      | reduce-scatter           |
| `reduce_scatter_to_sp`  | reduce-scatter (sequence)  | all-gather               |

Every function returns its input untouched when the group has one member, so tp=1 pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mscale.distributed.collectives import COMM_CLOCK, all_gather_into, reduce_scatter_into


@dataclass(frozen=True)
class TensorParallel:
    """Who this rank's tensor-parallel peers are, and whether activations are sequence-sharded."""

    group: dist.ProcessGroup | None
    """The TP process group; None only when ``size`` is 1."""
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    """Norms and residuals run on a 1/size slice of the sequence; TP all-reduces become
    reduce-scatter + all-gather (same bytes, 1/size of the activation memory)."""

    @classmethod
    def single(cls) -> "TensorParallel":
        """No tensor parallelism: every collective is skipped."""
        return cls(group=None, size=1, rank=0, sequence_parallel=False)

    @classmethod
    def from_groups(cls, groups, sequence_parallel: bool = False) -> "TensorParallel":
        """From `mscale.distributed.groups.ParallelGroups`."""
        return cls(group=groups.tp_group, size=groups.tp_size, rank=groups.tp_rank,
                   sequence_parallel=sequence_parallel)

    @property
    def sp(self) -> bool:
        """Sequence parallelism actually in effect (it means nothing at size 1)."""
        return self.sequence_parallel and self.size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Make a replicated-layout input ready for column-parallel layers: the full sequence on
        every rank, with the gradient summed over the group in backward."""
        return gather_from_sp(x, self) if self.sp else copy_to_tp(x, self)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """Sum row-parallel partial outputs over the group, back to the residual layout (the full
        sequence, or this rank's sequence shard under SP)."""
        return reduce_scatter_to_sp(x, self) if self.sp else reduce_from_tp(x, self)


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    # A fresh buffer: autograd may hand the same gradient tensor to several consumers.
    out = x.contiguous().clone()
    with COMM_CLOCK.timed("tp"):
        dist.all_reduce(out, group=tp.group)
    return out


def _gather_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    with COMM_CLOCK.timed("tp"):
        all_gather_into(out, x, tp.group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.shape[0] % tp.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={tp.size}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    with COMM_CLOCK.timed("tp"):
        reduce_scatter_into(out, x, tp.group)
    return out


def _own_chunk(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if x.shape[0] % tp.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tp={tp.size}")
    return x.chunk(tp.size, dim=0)[tp.rank].contiguous()


def _collective(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function that runs ``forward(x, tp)`` and, in backward, its adjoint
    ``backward(grad, tp)``: one row of the table above."""

    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, grad):
        return backward(grad, ctx.tp), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _identity(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x.view_as(x)  # a custom Function's output must be a new tensor or a view


_CopyToTP = _collective("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _collective("_ReduceFromTP", _all_reduce, _identity)
_ScatterToSP = _collective("_ScatterToSP", _own_chunk, _gather_seq)
_GatherFromSP = _collective("_GatherFromSP", _gather_seq, _reduce_scatter_seq)
_ReduceScatterToSP = _collective("_ReduceScatterToSP", _reduce_scatter_seq, _gather_seq)


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Identity forward, all-reduce backward: where a replicated tensor fans out into shards."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce forward, identity backward: where partial sums become the replicated result."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def scatter_to_sp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Keep this rank's chunk of dim 0 (sequence) of a replicated tensor; all-gather backward."""
    return x if tp.size == 1 else _ScatterToSP.apply(x, tp)


def gather_from_sp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-gather sequence shards (dim 0) forward; reduce-scatter the gradient backward."""
    return x if tp.size == 1 else _GatherFromSP.apply(x, tp)


def reduce_scatter_to_sp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk; all-gather backward."""
    return x if tp.size == 1 else _ReduceScatterToSP.apply(x, tp)
