"""Update math of AdamW and LAMB on flat fp32 tensors (one rank's owned shard).

Kept apart from the sharding (parallel/zero.py) so the formulas can be read and tested alone;
it lives in parallel/, not train/, so that parallel never imports upward.
The AdamW sequence of operations is torch.optim.AdamW's single-tensor path, op for op, so a DP
run matches a plain torch optimizer up to the rounding of the gradient reduction; on GPUs the
optimizer uses `fused_adamw_` instead (torch's fused kernel, as ``AdamW(fused=True)``).
"""

from __future__ import annotations

import math

import torch


def moments_(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             beta1: float, beta2: float) -> None:
    """Adam's first and second moment updates, in place."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                 eps: float) -> None:
    """One bias-corrected Adam step on ``master`` (decoupled weight decay is applied by the
    caller beforehand, as AdamW does: ``param *= 1 - lr·wd`` then this)."""
    moments_(grad, exp_avg, exp_avg_sq, beta1, beta2)
    bias1 = 1 - beta1 ** step
    bias2_sqrt = math.sqrt(1 - beta2 ** step)
    # torch.optim.AdamW writes ``(exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)``; dividing in place
    # gives the same bits without a second shard-sized temporary, whose fresh pages (glibc hands
    # a large block back to the OS on free) cost ~6× the arithmetic on CPU.
    denom = exp_avg_sq.sqrt().div_(bias2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


def fused_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor],
                 exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 step: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: torch.Tensor | None = None) -> None:
    """AdamW over lists of tensors (views of the flat shards) in fused kernels: the op behind
    ``torch.optim.AdamW(fused=True)``, decoupled weight decay included. ``step`` is a 0-dim
    float tensor on the device holding the step count after this step (no host sync).

    Why: `adam_update_` is about ten elementwise passes over the shard (each a kernel reading and
    writing shard-sized tensors); the fused kernel reads parameter, gradient and both moments and
    writes three of them once: ~7 shard-sized transfers instead of ~20, which on a GPU is the
    optimizer's whole cost (memory-bound). Its rounding differs from the single-tensor path's.
    ``grad_scale`` (0-dim, on the device): the kernel divides each gradient by it first (and
    writes the quotient back), which is how gradient clipping is applied without a pass of its
    own."""
    if params:
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [step] * len(params),
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                            amsgrad=False, maximize=False, grad_scale=grad_scale)


def lamb_direction(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                   step: int, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """LAMB's per-element update before weight decay and trust ratio (You et al., 2019):
    ``m̂ / (sqrt(v̂) + eps)``. The caller adds ``wd·w`` and scales each whole parameter by its
    trust ratio ``||w|| / ||update||``."""
    moments_(grad, exp_avg, exp_avg_sq, beta1, beta2)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    return (exp_avg / bias1).div_((exp_avg_sq / bias2).sqrt_().add_(eps))


def trust_ratio(w_sq: torch.Tensor, u_sq: torch.Tensor) -> torch.Tensor:
    """``||w|| / ||u||`` from squared norms; 1 where either is zero (fresh or frozen layers)."""
    ok = (w_sq > 0) & (u_sq > 0)
    return torch.where(ok, w_sq.sqrt() / u_sq.clamp_min(1e-300).sqrt(), torch.ones_like(w_sq))
