"""Initial values by global name: the same weights at every layout.

Each parameter's full initial tensor is a function of (seed, global name, shape) only, never of
where it lives: a single process, a TP=4 × PP=2 rank or a checkpoint conversion all derive the
same values. `init_weights` sets them on a plain model; the parallelize step
(`mscale.parallel.parallelize.init_parameters`) sets each rank's slice of the same tensors.

The values are drawn in tiles of `TILE` × `TILE`, each from a generator seeded by (seed, name,
tile index), so a rank draws only the tiles its shard overlaps, whichever dimension tensor
parallelism splits: a tp8 rank of GPT-3 175B draws about an eighth of what drawing each full
tensor and slicing it would, and holds one tile at a time instead of one full tensor (2.4 GB for
its largest matrix). docs/benchmarks.md ("initialising one rank") has the measurement.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
from torch import nn

from mscale.model.transformer import RMSNorm, Transformer

INIT_STD = 0.02
"""Standard deviation of the normal init of every matrix (GPT-2, LLaMA)."""
RESIDUAL_OUTPUTS = (".attn.wo.weight", ".mlp.down.weight")
"""Projections that write into the residual stream: their std is divided by sqrt(2·layers)
(GPT-2) so that the residual's variance does not grow with depth."""
TILE = 256
"""Edge of the tiles a matrix is drawn in (a vector: blocks of TILE² values). Large enough that
a tile's draw costs far more than seeding its generator, small enough that a shard boundary
(a multiple of dim/tp) wastes at most a thin band of tiles at each edge."""


def name_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name) that is the same in every process and Python version
    (Python's own hash() of a str is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, num_layers: int) -> float:
    """The normal init's std for matrix ``name``: 0.02, residual outputs scaled down with depth."""
    if name.endswith(RESIDUAL_OUTPUTS):
        return INIT_STD / math.sqrt(2 * num_layers)
    return INIT_STD


def _tile_edges(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 1:
        return (TILE * TILE,)
    if len(shape) == 2:
        return (TILE, TILE)
    raise ValueError(f"initial values are defined for vectors and matrices, not shape {shape}")


def _bounds(region: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of a region given as slices (None = the whole dimension)."""
    out = []
    for s, n in zip(region, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1 or start >= stop:
            raise ValueError(f"region {region} of shape {shape}: need non-empty unit-step slices")
        out.append((start, stop))
    return out


@torch.no_grad()
def fill_init(out: torch.Tensor, name: str, shape: tuple[int, ...],
              region: tuple[slice, ...], seed: int, num_layers: int, *, gain: bool) -> None:
    """Write the initial values of global tensor ``name`` (full ``shape``) that fall in
    ``region`` into ``out`` (the region's shape; any device and dtype): ones for a norm
    ``gain``, else each overlapped tile's N(0, std) draw, on the CPU in fp32, copied over."""
    bounds = _bounds(region, shape)
    if tuple(out.shape) != tuple(b - a for a, b in bounds):
        raise ValueError(f"{name}: out has shape {tuple(out.shape)}, region {bounds}")
    if gain:
        out.fill_(1.0)
        return
    std, edges = init_std(name, num_layers), _tile_edges(shape)
    generator = torch.Generator()
    ranges = [range(a // e, (b - 1) // e + 1) for (a, b), e in zip(bounds, edges)]
    for index in itertools.product(*ranges):
        lo = [i * e for i, e in zip(index, edges)]
        hi = [min(l + e, n) for l, e, n in zip(lo, edges, shape)]
        generator.manual_seed(name_seed(seed, f"{name}@{','.join(map(str, index))}"))
        tile = torch.empty([h - l for l, h in zip(lo, hi)]).normal_(0.0, std, generator=generator)
        cut = [(max(a, l), min(b, h)) for (a, b), l, h in zip(bounds, lo, hi)]
        out[tuple(slice(c0 - a, c1 - a) for (c0, c1), (a, _) in zip(cut, bounds))].copy_(
            tile[tuple(slice(c0 - l, c1 - l) for (c0, c1), l in zip(cut, lo))])



def global_init(name: str, shape: tuple[int, ...], seed: int, num_layers: int, *,
                gain: bool) -> torch.Tensor:
    """The full, unsharded initial value of parameter ``name``, in fp32 on the CPU."""
    out = torch.empty(shape)
    fill_init(out, name, shape, tuple(slice(None) for _ in shape), seed, num_layers, gain=gain)
    return out


def gain_names(model: nn.Module) -> set[str]:
    """Names of the norm gains (start at one, take no weight decay)."""
    return {f"{prefix}.weight" if prefix else "weight"
            for prefix, m in model.named_modules() if isinstance(m, RMSNorm)}


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Set every parameter of a plain (unsharded) model to `global_init`."""
    gains = gain_names(model)
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        fill_init(p.data, name, shape, tuple(slice(None) for _ in shape), seed,
                  model.cfg.layers, gain=name in gains)
