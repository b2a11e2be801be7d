"""Write a checkpoint for every rank of a plan from some source of global tensors.

Every offline conversion is this (`write_layout`): to another layout (`reshard`, the source a
`CheckpointReader`) and from HF weights (hf_io.import_hf). Each target rank's slices are computed
offline (ownership.for_plan, meta-device modules) exactly as a live rank of that plan would write
them, filled from the source, and committed like a training save. One process; memory is one
slice at a time (plus, for an HF import, the memory-mapped input).
"""

from __future__ import annotations

from typing import Callable

import torch

from mscale.ckpt import catalog
from mscale.ckpt.commit import build_manifest, reported_tensors, write_commit
from mscale.ckpt.limits import DEFAULT_CHUNK_BYTES
from mscale.ckpt.load import CheckpointReader, has_optimizer
from mscale.ckpt.manifest import Manifest, TrainState, itemsize
from mscale.ckpt.ownership import Item, for_plan, layout_record, write_items
from mscale.ckpt.progress import OnStart, Progress, Tally
from mscale.ckpt.snapshot import Snapshot
from mscale.ckpt.writer import write_shard
from mscale.config.plan import Plan

Source = Callable[[Item], torch.Tensor]
"""The data of one slice (1-D, ``item.count`` elements)."""


def write_layout(dst: str, plan: Plan, source: Source, state: TrainState, *, optimizer: bool,
                 level: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: Progress | None = None, on_start: OnStart | None = None) -> Manifest:
    """Write and commit a checkpoint of ``plan``'s layout at ``dst``; ``latest`` is moved to it
    too when ``dst`` sits in a run's ``ckpt/`` directory and ``latest`` names no newer step.
    Every rank's slices are worked out first, so that ``on_start`` can say how many tensors and
    bytes the whole job writes; ``progress`` counts the raw bytes of the slices written."""
    codec = "zstd" if level else "raw"
    meta: dict = {}
    ranks = [write_items(for_plan(plan, rank, meta), optimizer=optimizer)
             for rank in range(plan.layout.world_size)]
    tally = Tally(sum(_nbytes(it) for items in ranks for it in items), progress)
    if on_start is not None:
        on_start({"tensors": len({it.key for items in ranks for it in items}),
                  "bytes": tally.total, "ranks": len(ranks), "layout": layout_record(plan)})
    reports = [_write_rank(dst, rank, items, source, codec, level, chunk_bytes, tally)
               for rank, items in enumerate(ranks)]
    manifest = build_manifest(state.step, reports, codec=codec, level=level,
                              chunk_bytes=chunk_bytes, layout=layout_record(plan),
                              plan=plan.model_dump(mode="json", exclude_none=True), state=state)
    write_commit(dst, manifest)
    if in_run(dst):  # never backwards: a run's newer checkpoints stay its latest
        catalog.advance_latest(catalog.parent(dst), catalog.basename(dst))
    return manifest


def _nbytes(it: Item) -> int:
    return it.count * itemsize(it.dtype)


def _write_rank(dst: str, rank: int, items: list[Item], source: Source, codec: str, level: int,
                chunk_bytes: int, tally: Tally) -> dict:
    """One rank's shard. Its slices are read from ``source`` only as the writer reaches them
    (a generator): memory holds one slice, not the rank's, and progress moves slice by slice
    instead of stalling while a whole rank is read."""
    views = (source(it).detach().contiguous().reshape(-1).view(torch.uint8) for it in items)
    snap = Snapshot(items, views, 0.0, sum(_nbytes(it) for it in items))
    res = write_shard(dst, rank, snap, codec, level, chunk_bytes, on_slice=tally.add)
    return {"shard": res.info, "tensors": reported_tensors(items)}


def in_run(dst: str) -> bool:
    """True when ``dst`` is ``RUN/ckpt/step-NNNNNN``, where ``latest`` may follow it."""
    return (catalog.basename(catalog.parent(dst)) == "ckpt"
            and catalog.STEP_DIR.match(catalog.basename(dst)) is not None)


def reshard(src: str, manifest: Manifest, dst: str, plan: Plan, level: int = 1,
            progress: Progress | None = None, on_start: OnStart | None = None) -> Manifest:
    """The checkpoint at another layout (model and optimizer state)."""
    with CheckpointReader(src, manifest) as reader:
        state = manifest.state.model_copy(update={"rng_world": None})
        return write_layout(dst, plan, reader.read_item, state,
                            optimizer=has_optimizer(manifest), level=level,
                            progress=progress, on_start=on_start)
