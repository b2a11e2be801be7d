"""What every parameter knows about its place in the global model.

Each parameter the engine creates carries a `ParamSpec` (attribute ``mscale_spec``). The data-
parallel optimizer uses it to count a TP-replicated parameter once in the gradient norm, to skip
weight decay on norms, and the checkpoint uses it to write each shard's slice of the global tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPEC_ATTR = "mscale_spec"


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's identity in the unsharded model."""

    name: str
    """Global name, identical at every layout, e.g. ``layers.3.attn.wq.weight``."""
    global_shape: tuple[int, ...]
    """Shape of the full tensor before tensor-parallel sharding."""
    tp_dim: int | None
    """Dimension split over the TP group (rank i holds chunk i); None = replicated on TP ranks."""
    weight_decay: bool = True
    """False for norms and other gains that decay would pull to zero."""

    def tp_slice(self, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
        """The slice of the global tensor that TP rank ``tp_rank`` holds."""
        out = [slice(None)] * len(self.global_shape)
        if self.tp_dim is not None and tp_size > 1:
            n = self.global_shape[self.tp_dim] // tp_size
            out[self.tp_dim] = slice(tp_rank * n, (tp_rank + 1) * n)
        return tuple(out)


def set_spec(param: torch.nn.Parameter, spec: ParamSpec) -> torch.nn.Parameter:
    setattr(param, SPEC_ATTR, spec)
    return param


def get_spec(param: torch.Tensor) -> ParamSpec:
    spec = getattr(param, SPEC_ATTR, None)
    if spec is None:
        raise ValueError("parameter has no ParamSpec; create parameters through mscale.model")
    return spec
