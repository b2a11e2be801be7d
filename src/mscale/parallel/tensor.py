"""Tensor-parallel layers: sharded weights whose communication is explicit at the call site.

Each layer is built from the plain model's layer (`from_plain`), keeping this rank's slice of its
weight: a meta weight stays on meta (the values come later, from `parallelize.init_parameters` or
a checkpoint), a real one is sliced. The linear layers are local matmuls on a weight shard; they do
not communicate. The tensor-parallel block enters the TP region once (`TensorParallel.enter`) and
exits it once (`TensorParallel.exit`), so one collective serves several layers: Q, K and V share
one all-gather, and in the parallel block attention and MLP share one all-gather and one
reduce-scatter (MegaScale §3.1). A layer that hid its own collectives would make those fusions
impossible without flags on every layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mscale.distributed.collectives import COMM_CLOCK
from mscale.parallel.tensor_ops import (TensorParallel, copy_to_tp, gather_from_sp,
                                        reduce_from_tp, reduce_scatter_to_sp, scatter_to_sp)

__all__ = ["TensorParallel", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "shard_weight", "copy_to_tp", "reduce_from_tp",
           "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp"]


def shard_weight(weight: torch.Tensor, dim: int, tp: TensorParallel) -> nn.Parameter:
    """A new parameter holding TP rank ``tp.rank``'s chunk of ``weight`` along ``dim``."""
    if weight.shape[dim] % tp.size:
        raise ValueError(f"dimension {dim} of {tuple(weight.shape)} is not divisible by "
                         f"tp={tp.size}")
    n = weight.shape[dim] // tp.size
    part = weight.detach().narrow(dim, tp.rank * n, n)
    if weight.is_meta:
        return nn.Parameter(torch.empty(part.shape, dtype=weight.dtype, device="meta"))
    return nn.Parameter(part.clone())


class _ShardedLinear(nn.Module):
    """``y = x Wᵀ`` on this rank's shard of W (no bias: LLaMA-style)."""

    tp_dim: int
    """The dimension of the full ``[out, in]`` weight that is split over TP."""

    def __init__(self, plain: nn.Linear, tp: TensorParallel):
        super().__init__()
        if plain.bias is not None:
            raise ValueError("tensor-parallel linear layers have no bias")
        self.global_shape = tuple(plain.weight.shape)
        self.weight = shard_weight(plain.weight, self.tp_dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(_ShardedLinear):
    """W's output rows split over TP: input replicated, output sharded.

    ``weight`` is ``[out/tp, in]``; call it on a tensor that went through `TensorParallel.enter`.
    """

    tp_dim = 0


class RowParallelLinear(_ShardedLinear):
    """W's input columns split over TP: input sharded, output a partial sum.

    ``weight`` is ``[out, in/tp]``; pass the result through `TensorParallel.exit` to sum it.
    """

    tp_dim = 1


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over TP (``weight`` is ``[V/tp, h]``).

    Each rank looks up the tokens in its vocabulary range and writes zeros for the others; the
    sum over ranks (`TensorParallel.exit`: all-reduce, or reduce-scatter under SP) completes it.
    """

    tp_dim = 0

    def __init__(self, plain: nn.Embedding, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.global_shape = tuple(plain.weight.shape)
        self.weight = shard_weight(plain.weight, self.tp_dim, tp)

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
