"""Regional compilation: ``torch.compile`` applied to each block's compute regions.

What is compiled: every block's attention (projections, rotary, SDPA, output projection), its MLP
(projections and the SwiGLU/GeLU activation) and its plain RMSNorms. What is not: the
tensor-parallel collectives between them (`TensorParallel.enter`/`exit`, timed on the host and
issued on their own process groups), the residual adds, the embedding and the head. So no graph
contains a collective or a host timer, and the regions compile without a graph break
(tests/unit/parallel/test_compile.py checks ``fullgraph=True``).

Why regions and not the whole model: every block has the same regions with the same shapes, so
dynamo traces each region once and every layer reuses the compiled graph (parameters are graph
inputs), which keeps compile time independent of depth (torchtitan compiles per block for the
same reason). ``nn.Module.compile`` compiles a module in place: parameter and state-dict names do
not change, so checkpoints, the `ParamTable` and the optimizer see the same model.

A sequence-parallel norm's gain goes through an autograd function whose backward all-reduces,
which a graph may not hold: there only the normalisation is compiled (`SequenceParallelNorm.
normalize`), the module stays eager. Hooks of `ParamGather.attach_modules` go on the nearest
uncompiled module (`is_compiled` tells it which), since a hook inside a compiled region would
be traced into it.
"""

from __future__ import annotations

import torch
from torch import nn

from mscale.model.transformer import RMSNorm, rms_norm

REGIONS = ("attn", "mlp", "norm", "attn_norm", "mlp_norm")
"""The block children compiled, by name (a parallel block has ``norm``, a sequential one
``attn_norm`` and ``mlp_norm``)."""


def wants_compile(setting: bool | None, device: torch.device) -> bool:
    """``training.compile``: None means on with CUDA devices, off on CPUs."""
    return device.type == "cuda" if setting is None else setting


def compile_blocks(chunks: list[nn.Module], backend: str = "inductor",
                   fullgraph: bool = False) -> list[nn.Module]:
    """Compile the regions of every block of every chunk, in place; returns the modules
    (compiled, or a sequence-parallel norm whose normalisation is). ``backend`` and
    ``fullgraph`` are `torch.compile`'s (tests use ``aot_eager`` and ``fullgraph=True`` on CPU:
    the same capture, no code generation)."""
    out = []
    for chunk in chunks:
        for block in chunk.layers.values():
            for name in REGIONS:
                region = getattr(block, name, None)
                if region is None:
                    continue
                if isinstance(region, RMSNorm) and type(region) is not RMSNorm:  # SP norm
                    region.normalize = torch.compile(rms_norm, backend=backend,
                                                     fullgraph=fullgraph)
                else:
                    region.compile(backend=backend, fullgraph=fullgraph)
                out.append(region)
    return out


def is_compiled(module: nn.Module) -> bool:
    """True for a module compiled in place by `nn.Module.compile`."""
    return getattr(module, "_compiled_call_impl", None) is not None
