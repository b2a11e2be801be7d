"""Parameters by global name: deterministic initialisation and gathering of full tensors.

Both work from each parameter's `ParamSpec`, never from its local shape or position, which is
what makes a TP=4 × PP=2 run start from exactly the weights of a single process.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from mscale.distributed.collectives import all_gather_into
from mscale.parallel.spec import ParamSpec, get_spec
from mscale.parallel.tensor import TensorParallel

INIT_STD = 0.02
"""Standard deviation of the normal init of every matrix (GPT-2, LLaMA)."""
RESIDUAL_OUTPUTS = (".attn.wo.weight", ".mlp.down.weight")
"""Projections that write into the residual stream: their std is divided by sqrt(2·layers)
(GPT-2) so that the residual's variance does not grow with depth."""


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name) that is the same in every process and Python version
    (Python's own hash() of a str is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_init(spec: ParamSpec, seed: int, num_layers: int) -> torch.Tensor:
    """The full, unsharded initial value of one parameter, in fp32 on the CPU."""
    if not spec.weight_decay:  # norm gains start at one
        return torch.ones(spec.global_shape)
    std = INIT_STD
    if spec.name.endswith(RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * num_layers)
    generator = torch.Generator().manual_seed(name_seed(seed, spec.name))
    return torch.empty(spec.global_shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp: TensorParallel | None = None,
                    num_layers: int | None = None) -> None:
    """Set every parameter to its TP slice of `global_init` (seed, global name).

    ``tp`` and ``num_layers`` default to the module's own (``module.tp``, ``module.cfg.layers``).
    Costs one full-size tensor per parameter on the CPU, at start-up only.
    """
    tp = tp or getattr(module, "tp", None) or TensorParallel.single()
    if num_layers is None:
        num_layers = module.cfg.layers if hasattr(module, "cfg") else 1
    for p in module.parameters():
        spec = get_spec(p)
        p.copy_(global_init(spec, seed, num_layers)[spec.tp_slice(tp.rank, tp.size)])


def gather_tp(t: torch.Tensor, spec: ParamSpec, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard ``t`` → the full global tensor (a collective over the TP group)."""
    if spec.tp_dim is None or tp.size == 1:
        return t.detach().clone()
    moved = t.detach().movedim(spec.tp_dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * tp.size, *moved.shape[1:]))
    all_gather_into(out, moved, tp.group)
    return out.movedim(0, spec.tp_dim).contiguous()


def full_state_dict(module: nn.Module, tp: TensorParallel, *,
                    grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or, with ``grads``, its gradient; zeros if none) as a full global tensor
    keyed by global name, on every TP rank. For tests and checkpoint conversion: the training
    checkpoint is sharded and never gathers."""
    out = {}
    for p in module.parameters():  # parameters() lists a tied weight once
        spec = get_spec(p)
        t = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        out[spec.name] = gather_tp(t, spec, tp)
    return out
