"""Tensor-parallel layers: sharded weights whose communication is explicit at the call site.

The linear layers here are local matmuls on a weight shard; they do not communicate. The caller
enters the TP region once (`TensorParallel.enter`) and exits it once (`TensorParallel.exit`), so
one collective serves several layers: Q, K and V share one all-gather, and in the parallel block
attention and MLP share one all-gather and one reduce-scatter (MegaScale §3.1). A layer that hid
its own collectives would make those fusions impossible without flags on every layer.

Every parameter carries a `ParamSpec` with an empty name; `name_parameters` fills in the global
name from the module tree once the model is assembled, so the name is the attribute path and can
never drift from it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mscale.distributed.collectives import COMM_CLOCK
from mscale.parallel.spec import ParamSpec, get_spec, set_spec
from mscale.parallel.tensor_ops import (TensorParallel, copy_to_tp, gather_from_sp,
                                        reduce_from_tp, reduce_scatter_to_sp, scatter_to_sp)

__all__ = ["TensorParallel", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "sharded_parameter", "name_parameters", "copy_to_tp",
           "reduce_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp"]


def sharded_parameter(global_shape: tuple[int, ...], tp: TensorParallel, tp_dim: int | None,
                      weight_decay: bool = True) -> nn.Parameter:
    """An uninitialised fp32 parameter holding this rank's slice of ``global_shape``.

    Values come later from `mscale.model.init_parameters` (or a checkpoint), which derive them
    from the global name, so that every layout starts from the same weights.
    """
    spec = ParamSpec(name="", global_shape=tuple(global_shape), tp_dim=tp_dim,
                     weight_decay=weight_decay)
    shape = list(global_shape)
    if tp_dim is not None and tp.size > 1:
        if shape[tp_dim] % tp.size:
            raise ValueError(f"dimension {tp_dim} of {tuple(global_shape)} is not divisible by "
                             f"tp={tp.size}")
        shape[tp_dim] //= tp.size
    return set_spec(nn.Parameter(torch.empty(shape)), spec)


def name_parameters(module: nn.Module, prefix: str = "") -> None:
    """Write each parameter's attribute path into its ParamSpec as the global name."""
    for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
        set_spec(p, dataclasses.replace(get_spec(p), name=name))


class _ShardedLinear(nn.Module):
    """``y = x Wᵀ`` on this rank's shard of W (no bias: LLaMA-style)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, tp_dim: int):
        super().__init__()
        self.weight = sharded_parameter((out_features, in_features), tp, tp_dim=tp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(_ShardedLinear):
    """W's output rows split over TP: input replicated, output sharded.

    ``weight`` is ``[out/tp, in]``; call it on a tensor that went through `TensorParallel.enter`.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel):
        super().__init__(in_features, out_features, tp, tp_dim=0)


class RowParallelLinear(_ShardedLinear):
    """W's input columns split over TP: input sharded, output a partial sum.

    ``weight`` is ``[out, in/tp]``; pass the result through `TensorParallel.exit` to sum it.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel):
        super().__init__(in_features, out_features, tp, tp_dim=1)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over TP (``weight`` is ``[V/tp, h]``).

    Each rank looks up the tokens in its vocabulary range and writes zeros for the others; the
    sum over ranks (`TensorParallel.exit`: all-reduce, or reduce-scatter under SP) completes it.
    """

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = sharded_parameter((vocab, hidden), tp, tp_dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[s, b]`` → ``[s, b, h]`` (``[s/tp, b, h]`` under SP)."""
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        per_rank = self.weight.shape[0]
        local = tokens - self.tp.rank * per_rank
        outside = (local < 0) | (local >= per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.exit(out)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy on vocabulary-sharded logits ``[n, V/tp]``.

    Three small collectives over ``[n]``-sized vectors (max; target logit and sum of exps in one)
    replace gathering ``[n, V]`` logits. Subtracting the global max keeps exp() in range.
    """

    @staticmethod
    def forward(ctx, logits, labels, tp):
        per_rank = logits.shape[-1]
        max_logit = logits.max(dim=-1).values
        if tp.size > 1:
            with COMM_CLOCK.timed("tp"):
                dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - max_logit.unsqueeze(-1)
        local = labels - tp.rank * per_rank
        inside = (local >= 0) & (local < per_rank)
        local = local.masked_fill(~inside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = shifted.exp()
        sums = torch.stack([target, exp.sum(dim=-1)])
        if tp.size > 1:
            with COMM_CLOCK.timed("tp"):
                dist.all_reduce(sums, group=tp.group)
        target, sum_exp = sums[0], sums[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, inside)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                 tp: TensorParallel) -> torch.Tensor:
    """Mean cross-entropy over all tokens; ``logits`` ``[..., V/tp]``, ``labels`` ``[...]``.

    Computed in fp32 whatever the logits' dtype. Every TP rank returns the same value.
    """
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]).float(),
                                                 labels.reshape(-1), tp)
    return per_token.mean()
