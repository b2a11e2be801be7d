"""Stage 2 of a save: serialise, compress and write one shard file, on a background thread.

The thread does file I/O only (no collective ever runs off the training thread: a collective
from a second thread on the TP or default group can interleave with training's own and deadlock,
as torch.distributed.checkpoint's thread-mode async_save does; docs/references.md). zstd, crc32
and file writes release the GIL, so training keeps running; on a machine with few cores it does
slow down while a write is in flight (~2x measured on 2 cores, docs/references.md).

Durability: each shard is flushed and fsynced before its job reports success, and a failed fsync
fails the job (the save becomes a ``checkpoint_failed`` event, ``latest`` stays); the commit
marker is written only after every rank's job has succeeded (commit.py).
"""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from mscale.ckpt.catalog import fs_and_path, is_local, join
from mscale.ckpt.format import Encoder, shard_checksum, write_slice
from mscale.ckpt.manifest import ShardInfo, SliceInfo, shard_name
from mscale.ckpt.snapshot import CopyGate, HostArena, Snapshot, use_device


@dataclass
class ShardResult:
    """What a finished write reports back to rank 0 (JSON-able)."""

    info: dict
    """A `ShardInfo` as a dict."""
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


def inject_fault(fault: str, fh, where: str) -> None:
    """Test hooks (--inject-ckpt-enospc/-kill/-hang): what a full disk, a crash or a hang in the
    middle of a write does, for real — the chunks so far are flushed to the file first, so the
    attempt left behind is a partial shard as a real crash leaves it."""
    fh.flush()
    if fault == "enospc":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (test hook "
                      "--inject-ckpt-enospc)", where)
    sys.stderr.write(f"test hook --inject-ckpt-{fault}: this rank "
                     f"{'SIGKILLs' if fault == 'kill' else 'SIGSTOPs'} itself writing {where}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def _chunk_hook(fh, where: str, chunk_delay_s: float, fault: str | None):
    """What runs after each chunk: the test delay, and the injected fault after the first."""
    if not chunk_delay_s and not fault:
        return None
    written = [0]

    def on_chunk() -> None:
        written[0] += 1
        if chunk_delay_s:
            time.sleep(chunk_delay_s)
        if fault and written[0] == 1:
            inject_fault(fault, fh, where)
    return on_chunk


def write_shard(ckpt_dir: str, rank: int, snap: Snapshot, codec: str, level: int,
                chunk_bytes: int, chunk_delay_s: float = 0.0,
                fault: str | None = None) -> ShardResult:
    """Write this rank's snapshot as ``rank-NNNNN.bin``; returns its `ShardInfo` and timings.
    ``chunk_delay_s`` (tests) sleeps after each chunk, to hold a write in flight; ``fault``
    (tests: enospc, kill, hang) strikes after the first chunk (`inject_fault`)."""
    t0 = time.perf_counter()
    encoder = Encoder(codec, level, chunk_bytes)
    name = shard_name(rank)
    slices, crcs, offset = [], [], 0
    with _open(join(ckpt_dir, name)) as fh, ThreadPoolExecutor(1, "mscale-ckpt-enc") as pool:
        on_chunk = _chunk_hook(fh, join(ckpt_dir, name), chunk_delay_s, fault)
        for it, view in zip(snap.items, snap.views):
            table = write_slice(fh, encoder, memoryview(view.numpy()), on_chunk, pool)
            slices.append(SliceInfo(tensor=it.key, box=[list(b) for b in it.box],
                                    flat=list(it.flat), offset=offset, chunks=table))
            crcs += [c[1] for c in table]
            offset += sum(c[0] for c in table)
        _sync(fh)
    info = ShardInfo(path=name, rank=rank, bytes=offset, checksum=shard_checksum(crcs),
                     slices=slices)
    return ShardResult(info.model_dump(), time.perf_counter() - t0, offset, snap.nbytes)


def snapshot_and_write(arena: HostArena, gate: CopyGate, items, sources, after, ckpt_dir: str,
                       rank: int, codec: str, level: int, chunk_bytes: int,
                       chunk_delay_s: float = 0.0, copy_delay_s: float = 0.0, *,
                       device: torch.device | None = None,
                       fault: str | None = None) -> tuple[ShardResult, float]:
    """Stage 1 (copy to host; then open the gate for the optimizer step) and stage 2 (write),
    both on the writer thread, which first makes ``device`` (the rank's, captured by `save` on
    the training thread) its current CUDA device. Returns the write's result and the copy's
    seconds."""
    try:
        use_device(device)
        if copy_delay_s:  # test hook: a slow copy, so the optimizer step must wait for it
            time.sleep(copy_delay_s)
        snap = arena.take(items, sources, after, device)
    finally:
        gate.open()  # never leave training blocked, even if the copy failed
    return (write_shard(ckpt_dir, rank, snap, codec, level, chunk_bytes, chunk_delay_s, fault),
            snap.seconds)


class BackgroundWriter:
    """One thread, jobs in order. A failed job's exception is kept in its future, never raised
    into training."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mscale-ckpt")

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
