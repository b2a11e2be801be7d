"""Initial values by global name: the same weights at every layout.

Each parameter's full initial tensor is a function of (seed, global name, shape) only, never of
where it lives: a single process, a TP=4 × PP=2 rank or a checkpoint conversion all derive the
same values. `init_weights` sets them on a plain model; the parallelize step
(`mscale.parallel.parallelize.init_parameters`) sets each rank's slice of the same tensors.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from mscale.model.transformer import RMSNorm, Transformer

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


def global_init(name: str, shape: tuple[int, ...], seed: int, num_layers: int, *,
                gain: bool) -> torch.Tensor:
    """The full, unsharded initial value of parameter ``name``, in fp32 on the CPU: ones for a
    norm ``gain``, else N(0, 0.02) (residual outputs scaled down with depth)."""
    if gain:
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(RESIDUAL_OUTPUTS):
        std /= math.sqrt(2 * num_layers)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def gain_names(model: nn.Module) -> set[str]:
    """Names of the norm gains (start at one, take no weight decay)."""
    return {f"{prefix}.weight" if prefix else "weight"
            for prefix, m in model.named_modules() if isinstance(m, RMSNorm)}


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Set every parameter of a plain (unsharded) model to `global_init`."""
    gains = gain_names(model)
    for name, p in model.named_parameters():
        p.copy_(global_init(name, tuple(p.shape), seed, model.cfg.layers, gain=name in gains))
