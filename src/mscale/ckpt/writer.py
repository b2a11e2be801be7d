"""Stage 2 of a save: serialise, compress and write one shard file, on a background thread.

The thread does file I/O only (no collective ever runs off the training thread: a collective
from a second thread on the TP or default group can interleave with training's own and deadlock,
as torch.distributed.checkpoint's thread-mode async_save does; docs/references.md). zstd, crc32
and file writes release the GIL, so training keeps running; on a machine with few cores it does
slow down while a write is in flight (~2x measured on 2 cores, docs/references.md).

Each shard's slice table goes to its own index file beside it (``rank-NNNNN.index.json``, written
and fsynced after the shard); the report to rank 0 names the index by size and sha256, a few
hundred bytes a rank whatever the shard holds (manifest.py says why).

Durability: each shard is flushed and fsynced before its job reports success, and a failed fsync
fails the job (the save becomes a ``checkpoint_failed`` event, ``latest`` stays); the commit
marker is written only after every rank's job has succeeded (commit.py).
"""

from __future__ import annotations

import io
import itertools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from mscale.ckpt.files import is_local, join
from mscale.ckpt.format import Encoder, shard_checksum, write_slice
from mscale.ckpt.manifest import (IndexRef, ShardIndex, ShardInfo, SliceInfo, index_name, sha256,
                                  shard_name)
from mscale.ckpt.snapshot import CopyGate, HostArena, Snapshot, use_device
from mscale.runs.atomic import fs_and_path


@dataclass
class ShardResult:
    """What a finished write reports back to rank 0 (JSON-able)."""

    info: dict
    """A `ShardInfo` as a dict (its slices in the index file it names)."""
    seconds: float
    stored_bytes: int
    raw_bytes: int


def _open(url: str):
    fs, path = fs_and_path(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if is_local(fs):
        return open(path, "wb")
    return fs.open(path, "wb")


def _sync(fh) -> None:
    """Flush and fsync a shard. Every error propagates: a shard whose fsync failed (EIO, ENOSPC
    on a network filesystem's write-back) may never reach the disk, and a checkpoint committed
    over it would be trusted and lost. Only a handle with no file descriptor (an object store's
    whole-object upload, memory://) has nothing to fsync; its write completes on close."""
    fh.flush()
    try:
        fd = fh.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return
    os.fsync(fd)


class WriteHooks(Protocol):
    """Calls a save's writer makes at two points of its work, for whoever installed them (the
    training job's fault injection, train/faults.py; a slow-filesystem test). The writer knows
    nothing of what they do."""

    def before_copy(self) -> None:
        """On the writer thread, before the host copy (the optimizer step waits for the copy)."""

    def after_chunk(self, fh, path: str, index: int) -> None:
        """After chunk ``index`` (0-based, counted over the shard) is written to ``fh``."""


def _chunk_callback(hooks: WriteHooks | None, fh, path: str):
    if hooks is None:
        return None
    count = itertools.count()
    return lambda: hooks.after_chunk(fh, path, next(count))


def write_index(ckpt_dir: str, rank: int, shard: str, slices: list[SliceInfo]) -> IndexRef:
    """Write and fsync a shard's slice table; returns what the manifest records of it."""
    data = ShardIndex(shard=shard, rank=rank, slices=slices).model_dump_json().encode()
    name = index_name(rank)
    with _open(join(ckpt_dir, name)) as fh:
        fh.write(data)
        _sync(fh)
    return IndexRef(path=name, bytes=len(data), sha256=sha256(data))


def write_shard(ckpt_dir: str, rank: int, snap: Snapshot, codec: str, level: int,
                chunk_bytes: int, hooks: WriteHooks | None = None,
                on_slice: Callable[[int], None] | None = None) -> ShardResult:
    """Write this rank's snapshot as ``rank-NNNNN.bin`` and its slice table as
    ``rank-NNNNN.index.json``; returns its `ShardInfo` and timings.
    ``on_slice`` gets each slice's raw bytes once they are written (an offline convert's
    progress; a training save has none)."""
    t0 = time.perf_counter()
    encoder = Encoder(codec, level, chunk_bytes)
    name = shard_name(rank)
    slices, crcs, offset = [], [], 0
    with _open(join(ckpt_dir, name)) as fh, ThreadPoolExecutor(1, "mscale-ckpt-enc") as pool:
        on_chunk = _chunk_callback(hooks, fh, join(ckpt_dir, name))
        for it, view in zip(snap.items, snap.views):
            table = write_slice(fh, encoder, memoryview(view.numpy()), on_chunk, pool)
            slices.append(SliceInfo(tensor=it.key, box=[list(b) for b in it.box],
                                    flat=list(it.flat), offset=offset, chunks=table))
            crcs += [c[1] for c in table]
            offset += sum(c[0] for c in table)
            if on_slice is not None:
                on_slice(view.numel())
        _sync(fh)
    info = ShardInfo(path=name, rank=rank, bytes=offset, checksum=shard_checksum(crcs),
                     index=write_index(ckpt_dir, rank, name, slices))
    return ShardResult(info.model_dump(), time.perf_counter() - t0, offset, snap.nbytes)


def snapshot_and_write(arena: HostArena, gate: CopyGate, items, sources, after, ckpt_dir: str,
                       rank: int, codec: str, level: int, chunk_bytes: int, *,
                       device: torch.device | None = None,
                       hooks: WriteHooks | None = None) -> tuple[ShardResult, float]:
    """Stage 1 (copy to host; then open the gate for the optimizer step) and stage 2 (write),
    both on the writer thread, which first makes ``device`` (the rank's, captured by `save` on
    the training thread) its current CUDA device. Returns the write's result and the copy's
    seconds."""
    try:
        use_device(device)
        if hooks is not None:
            hooks.before_copy()
        snap = arena.take(items, sources, after, device)
    finally:
        gate.open()  # never leave training blocked, even if the copy failed
    return write_shard(ckpt_dir, rank, snap, codec, level, chunk_bytes, hooks), snap.seconds


class BackgroundWriter:
    """One thread, jobs in order. A failed job's exception is kept in its future, never raised
    into training."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mscale-ckpt")

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
