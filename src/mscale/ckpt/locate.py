"""Which saved shards hold what a resuming rank reads back: the index files it opens first.

A schema-2 checkpoint keeps each shard's slice list in its own index file (manifest.py), and
at 12,288 ranks reading all of them costs every rank ~150 s and ~5 GB (docs/benchmarks.md).
The saving plan is in the manifest, so a rank can compute, from the write rules of
ownership.py, which old ranks wrote any element it needs, and read only those indexes:

- the same TP/PP split (ZeRO 1 and 2 shard alike): its own (pp, tp) coordinate's replicas, TP rank 0's for
  the replicated parameters, and under ZeRO 1/2 only the replicas whose shards overlap its own
  (`overlapping_shards`, from the bucket sizes): one or two ranks, a few after a DP change (a
  small superset: TP rank 0 is named even where it wrote nothing this rank reads);
- another TP/PP split (recover's planner search may choose one), or ZeRO 0 against 1/2: the
  old coordinates whose parameters overlap its own, then the replicas there whose write set
  overlaps what it reads, element by element (`_resplit_writers`, exact); a few seconds of
  arithmetic at 175B instead of reading 12,288 indexes.

A wrong answer costs time, not correctness: `load.CheckpointReader` reads every other index
when the ones named do not cover a region.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from mscale.ckpt.manifest import MODEL, OPTIM_KEYS, optim_key, tensor_key
from mscale.ckpt.ownership import (Item, RankLayout, layout_record, model_needs, optim_needs,
                                   replica_layouts, write_items)
from mscale.ckpt.slices import intersect, region_boxes
from mscale.parallel.buckets import BufferLayout
from mscale.parallel.shard_layout import bucket_bytes, bucket_numel, shard_index
from mscale.topology.placement import placement_for


def likely_writers(saved_plan, plan, rl: RankLayout, optimizer: bool) -> set[int]:
    """The ranks of ``saved_plan`` whose shards hold what rank ``rl`` of ``plan`` reads back
    (its optimizer state when ``optimizer``, else its parameters; see the module docstring)."""
    old, new = saved_plan.layout, plan.layout
    if optimizer and new.zero_stage == 0 and rl.dp_rank != 0:
        # DP rank 0 reads the replicas' optimizer state and broadcasts it (load.py); at the same
        # layout (as the checkpointer compares it) the RNG states come from the rank's own shard
        return {rl.rank} if layout_record(saved_plan) == layout_record(plan) else set()
    if (old.tp, old.pp, old.vpp) != (new.tp, new.pp, new.vpp) or (
            optimizer and (old.zero_stage == 0) != (new.zero_stage == 0)):  # other writers
        return _resplit_writers(saved_plan, optim_needs(rl) if optimizer else model_needs(rl),
                                optimizer)
    placement = placement_for(saved_plan)
    out = {rl.rank} if old.dp == new.dp else set()  # the RNG states: read at the same layout
    shards = None
    if optimizer and min(old.zero_stage, new.zero_stage) > 0:
        mine = shard_index(placement_for(plan), rl.rank, new.dp_reduce == "hierarchical")
        shards = overlapping_shards(mine, bucket_fills(rl, plan), new.dp,
                                    bucket_fills(rl, saved_plan), old.dp)
    hierarchical = old.dp_reduce == "hierarchical"
    for tp in {rl.tp_rank, 0}:
        for d in range(old.dp):
            r = placement.rank(d, rl.pp_rank, tp)
            if shards is None or shard_index(placement, r, hierarchical) in shards:
                out.add(r)
    return out


def _resplit_writers(saved_plan, needs: list[Item], optimizer: bool) -> set[int]:
    """The ranks of ``saved_plan`` whose write set (`write_items`) overlaps any region of
    ``needs``. Only the (pp, tp) coordinates holding an overlapping parameter are searched
    replica by replica (`replica_layouts`: what the replicas share is built once)."""
    wanted: dict[str, list] = {}
    for it in needs:
        wanted.setdefault(it.key, []).extend(b for b, _ in region_boxes(it.box, it.flat))
    layout, meta = saved_plan.layout, {}
    out = set()
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            replicas = replica_layouts(saved_plan, pp, tp, meta)
            first = next(replicas)
            if not any(_overlaps(it, wanted) for it in _held(first, optimizer)):
                continue
            for rl in itertools.chain([first], replicas):
                if any(_overlaps(it, wanted) for it in write_items(rl, optimizer)):
                    out.add(rl.rank)
    return out


def _held(rl: RankLayout, optimizer: bool) -> list[Item]:
    """Every parameter of ``rl``'s (pp, tp) coordinate, whole, under each key a replica of it
    may write it under: what the coordinate's replicas together hold."""
    kinds = OPTIM_KEYS if optimizer else ()
    return [Item(key, tuple(p.spec.global_shape), p.dtype, p.box, (0, p.numel), ())
            for p in rl.params
            for key in [tensor_key(MODEL, p.spec.name)] + [optim_key(k, p.spec.name)
                                                            for k in kinds]]


def _overlaps(it: Item, wanted: dict[str, list]) -> bool:
    boxes = wanted.get(it.key)
    if not boxes:
        return False
    return any(intersect(mine, theirs) is not None
               for mine, _ in region_boxes(it.box, it.flat) for theirs in boxes)


def bucket_fills(rl: RankLayout, plan) -> list[int]:
    """The elements of each DP bucket over ``rl``'s parameters with ``plan``'s bucket size,
    padding left out: the gradient buffer's own layout (`BufferLayout`), which does not depend
    on the DP size."""
    shapes = [_Shape(tuple(b - a for a, b in p.box)) for p in rl.params]
    layout = BufferLayout(shapes, [p.spec for p in rl.params], 1,
                          bucket_numel(bucket_bytes(plan.training)))
    return [b.numel for b in layout.buckets]


@dataclass(frozen=True)
class _Shape:
    """What `BufferLayout` reads of a parameter."""

    shape: tuple[int, ...]


def overlapping_shards(i: int, fills: list[int], dp: int, saved_fills: list[int],
                       saved_dp: int) -> set[int]:
    """The ZeRO shards of a layout split ``saved_dp`` ways (bucket sizes ``saved_fills``) that
    hold any element of shard ``i`` of one split ``dp`` ways (``fills``). Both lay the same
    parameters out in the same order, so an element has one position in the buckets'
    concatenation without padding; shard ``j`` of a bucket of ``f`` elements holds its elements
    ``j·ceil(f/dp)`` up to ``(j+1)·ceil(f/dp)``."""
    want, start = [], 0
    for f in fills:
        n = -(-f // dp)
        lo, hi = start + i * n, start + min((i + 1) * n, f)
        if lo < hi:
            want.append((lo, hi))
        start += f
    out, start = set(), 0
    for f in saved_fills:
        n = -(-f // saved_dp)
        for lo, hi in want:
            a, z = max(lo, start), min(hi, start + f)
            if a < z:
                out.update(range((a - start) // n, -(-(z - start) // n)))
        start += f
    return out
