"""Who writes what, and what each rank needs back: the checkpoint's view of one rank.

A `RankLayout` is a rank's coordinates plus its parameters (global name, TP box) and its optimizer
pieces (flat ranges of TP-local tensors, from the ZeRO buffer layout). A live training process
gives one (`from_live`); `for_plan` builds the same thing offline for any rank of any plan from
meta-device modules (no memory, no process groups), which is what offline conversion uses. Both
take the bucket size and the ZeRO shard order from `mscale.parallel.shard_layout`, the functions
the gradient buffer uses, so the two cannot disagree (tests/distributed/test_ckpt_layout.py compares them
on live engines).

Write rules (`write_items`), so that every element is written exactly once and the writing is
spread over all ranks:

- a TP-replicated parameter (norm gains) is identical on every TP rank: TP rank 0 writes it;
- an fp32 parameter is not written at all when the optimizer state is: after every step the
  parameters *are* the fp32 master weights (the optimizer copies them in), so the manifest says
  ``model_alias`` and readers take ``model/<name>`` from ``optim.master/<name>``: 12 bytes per
  parameter instead of 16. Other parameters (bf16 weights, model-only checkpoints) are written;
- model parameters are identical on every DP replica: the replicas split them, each parameter to
  one DP rank, balanced by size (MegaScale: every rank writes, none gathers);
- optimizer state under ZeRO 1/2: each DP rank writes its own shard; under ZeRO 0 every replica
  holds all of it, so it follows the model split;
- RNG states: every rank its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator

import torch

from mscale.ckpt.format import dtype_name
from mscale.ckpt.live import LiveRank
from mscale.ckpt.manifest import MASTER_DTYPE, MODEL, OPTIM_KEYS, itemsize, optim_key, tensor_key
from mscale.ckpt.slices import Box, box_from_slices, numel
from mscale.parallel.buckets import BufferLayout, Piece
from mscale.parallel.shard_layout import bucket_bytes, bucket_numel, owned_shard
from mscale.parallel.spec import ParamSpec, ParamTable
from mscale.topology.placement import placement_for


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of this rank."""

    index: int
    """Position in the rank's parameter list (chunks in order, registration order within)."""
    spec: ParamSpec
    box: Box
    """Its TP slice of the global tensor."""
    dtype: str

    @property
    def numel(self) -> int:
        return numel([b - a for a, b in self.box])

    @property
    def replicated(self) -> bool:
        """Same values on every TP rank."""
        return self.spec.tp_dim is None


@dataclass(frozen=True)
class OptPiece:
    """``local_flat[lo:hi]`` of parameter ``param``, stored at ``owned_lo`` of the optimizer's flat
    state tensors."""

    param: int
    lo: int
    hi: int
    owned_lo: int


@dataclass
class RankLayout:
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    dp_size: int
    pp_size: int
    tp_size: int
    zero_stage: int
    params: list[ParamSlot]
    pieces: list[OptPiece]
    _model_owner: list[int] = field(default_factory=list, repr=False, compare=False)

    def model_owner(self) -> list[int]:
        """DP rank that writes each parameter (balanced by size; the same on every replica)."""
        if not self._model_owner:
            self._model_owner = balance([p.numel * itemsize(p.dtype) if self.writes_param(p)
                                         else 0 for p in self.params], self.dp_size)
        return self._model_owner

    def writes_param(self, p: ParamSlot) -> bool:
        return not p.replicated or self.tp_rank == 0


def balance(sizes: list[int], bins: int) -> list[int]:
    """Owner bin of each item: largest first onto the least loaded bin (ties: lowest index).
    A heap of (load, bin): the same choice as scanning every bin, in log(bins) per item (a
    resume at a new split computes this for every replica of a few coordinates, locate.py)."""
    heap = [(0, b) for b in range(max(1, bins))]
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)
        owner[i] = b
        heapq.heappush(heap, (load + sizes[i], b))
    return owner


@dataclass(frozen=True)
class Item:
    """One slice a rank writes (or one region it reads)."""

    key: str
    shape: tuple[int, ...]
    """Global shape."""
    dtype: str
    box: Box
    flat: tuple[int, int]
    source: tuple
    """``("param", index)`` or ``("optim", key, piece index)`` or ``("rng", kind)``."""

    @property
    def count(self) -> int:
        return self.flat[1] - self.flat[0]


def write_items(rl: RankLayout, optimizer: bool = True) -> list[Item]:
    """The slices this rank writes (rules in the module docstring); ``optimizer=False``: a
    model-only checkpoint."""
    owner = rl.model_owner()
    mine = [p for p in rl.params if rl.writes_param(p) and owner[p.index] == rl.dp_rank]
    items = [Item(tensor_key(MODEL, p.spec.name), tuple(p.spec.global_shape), p.dtype, p.box,
                  (0, p.numel), ("param", p.index))
             for p in mine if not (optimizer and p.dtype == MASTER_DTYPE)]
    if not optimizer:
        return items
    mine_idx = {p.index for p in mine}
    for k, pc in enumerate(rl.pieces):
        p = rl.params[pc.param]
        if not rl.writes_param(p) or (rl.zero_stage == 0 and pc.param not in mine_idx):
            continue
        for key in OPTIM_KEYS:
            items.append(Item(optim_key(key, p.spec.name), tuple(p.spec.global_shape), "float32",
                              p.box, (pc.lo, pc.hi), ("optim", key, k)))
    return items


def optim_needs(rl: RankLayout) -> list[Item]:
    """Every optimizer region this rank holds (all of them, replicated or not), to load."""
    out = []
    for k, pc in enumerate(rl.pieces):
        p = rl.params[pc.param]
        for key in OPTIM_KEYS:
            out.append(Item(optim_key(key, p.spec.name), tuple(p.spec.global_shape), "float32",
                            p.box, (pc.lo, pc.hi), ("optim", key, k)))
    return out


def model_needs(rl: RankLayout) -> list[Item]:
    """Every parameter this rank holds, whole, to load."""
    return [Item(tensor_key(MODEL, p.spec.name), tuple(p.spec.global_shape), p.dtype, p.box,
                 (0, p.numel), ("param", p.index)) for p in rl.params]


def layout_record(plan) -> dict:
    """The ``layout`` a manifest records: enough to tell whether a load reshards."""
    lo = plan.layout
    return {"tp": lo.tp, "pp": lo.pp, "dp": lo.dp, "vpp": lo.vpp, "zero_stage": lo.zero_stage,
            "world": lo.world_size}


# --------------------------------------------------------------------------- building layouts
def _slots(params, table: ParamTable) -> list[ParamSlot]:
    out = []
    for i, (p, spec) in enumerate(zip(params, table, strict=True)):
        box = box_from_slices(table.local_slice(spec), spec.global_shape)
        out.append(ParamSlot(i, spec, box, dtype_name(p.dtype)))
    return out


def _pieces(buffer_pieces: list[Piece]) -> list[OptPiece]:
    return [OptPiece(pc.param_index, pc.param_lo, pc.param_hi, pc.owned_lo) for pc in buffer_pieces]


def from_live(live: LiveRank) -> RankLayout:
    """The layout of a live training process: its parameters and its optimizer's pieces."""
    g = live.groups
    return RankLayout(rank=g.rank, dp_rank=g.dp_rank, pp_rank=g.pp_rank, tp_rank=g.tp_rank,
                      dp_size=g.dp_size, pp_size=g.pp_size, tp_size=g.tp_size,
                      zero_stage=live.plan.layout.zero_stage,
                      params=_slots(live.params, live.table),
                      pieces=_pieces(live.optimizer.pieces))


def meta_params(plan, pp_rank: int,
                tp_rank: int) -> tuple[list[torch.nn.Parameter], ParamTable]:
    """The parameters rank (pp_rank, tp_rank) of ``plan`` would hold, on the meta device, and
    their table."""
    from mscale.parallel.parallelize import build_chunks
    from mscale.parallel.tensor import TensorParallel

    layout = plan.layout
    tp = TensorParallel(group=None, size=layout.tp, rank=tp_rank,
                        sequence_parallel=layout.sequence_parallel)
    chunks, table = build_chunks(plan, pp_rank, tp, torch.device("meta"))
    return [p for c in chunks for p in c.parameters()], table


def for_plan(plan, rank: int, meta: dict | None = None) -> RankLayout:
    """The layout of ``rank`` under ``plan``, built offline: the buffer layout the gradient
    buffer would build over the same parameters, and the shard the DP reduction would leave it.
    ``meta``: `meta_params` by (pp, tp) rank, shared by the calls for one plan's ranks (an offline
    convert plans them all before writing): building the meta modules is most of the cost, and
    every DP replica holds the same (read only here)."""
    coord = placement_for(plan).coord(rank)
    params, table, buffer = _coordinate(plan, coord.pp, coord.tp, meta)
    return _rank_layout(plan, rank, _slots(params, table), buffer)


def replica_layouts(plan, pp_rank: int, tp_rank: int,
                    meta: dict | None = None) -> Iterator[RankLayout]:
    """The layouts of every DP replica of coordinate (``pp_rank``, ``tp_rank``) of ``plan``, DP
    rank 0 first, each as `for_plan` builds it. The replicas differ only in their ZeRO shard, so
    the buffer layout, the parameter slots and the model split are built once: a resume at a new
    TP/PP split looks at every replica of a few coordinates (locate.py)."""
    params, table, buffer = _coordinate(plan, pp_rank, tp_rank, meta)
    slots, owner, placement = _slots(params, table), [], placement_for(plan)
    for d in range(plan.layout.dp):
        rl = _rank_layout(plan, placement.rank(d, pp_rank, tp_rank), slots, buffer, owner)
        owner = rl.model_owner()
        yield rl


def _coordinate(plan, pp_rank: int, tp_rank: int, meta: dict | None):
    """The meta parameters of coordinate (pp, tp), their table (cached in ``meta``) and the
    gradient buffer's layout over them."""
    key = (pp_rank, tp_rank)
    params, table = (meta or {}).get(key) or meta_params(plan, *key)
    if meta is not None:
        meta[key] = (params, table)
    buffer = BufferLayout(params, table, plan.layout.dp,
                          bucket_numel(bucket_bytes(plan.training)))
    return params, table, buffer


def _rank_layout(plan, rank: int, slots: list[ParamSlot], buffer: BufferLayout,
                 owner: list[int] | None = None) -> RankLayout:
    """``rank``'s layout over its coordinate's ``slots`` and ``buffer``; ``owner``: the model
    split when another replica computed it already."""
    layout, placement = plan.layout, placement_for(plan)
    coord = placement.coord(rank)
    shard = owned_shard(placement, rank, layout.zero_stage, layout.dp_reduce == "hierarchical")
    return RankLayout(rank=rank, dp_rank=coord.dp, pp_rank=coord.pp, tp_rank=coord.tp,
                      dp_size=layout.dp, pp_size=layout.pp, tp_size=layout.tp,
                      zero_stage=layout.zero_stage, params=slots,
                      pieces=_pieces(buffer.pieces(shard)), _model_owner=owner or [])
