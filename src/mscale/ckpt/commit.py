"""The commit protocol: all ranks durable → manifest → commit marker → ``latest`` → retention.

1. Every rank's background job writes and fsyncs its shard (writer.py).
2. At each step boundary, on the training thread, one small SUM all-reduce on the checkpoint's
   own gloo group asks "is any rank still writing, did any fail?" (`status`). No collective ever
   runs on a background thread, and none touches the TP/DP/default groups.
3. When none is writing, every rank's result (shard info or error: a few hundred bytes, the
   slices are in the shard's index file) is gathered to rank 0 as JSON bytes (`gather_raw`),
   again at a step boundary. Rank 0's writer thread decodes them and
   builds the manifest (`build_manifest`): the training thread goes on (a save that failed on
   some rank is judged on the training thread, so that a full disk stops the job there).
4. Rank 0, on its writer thread, first re-reads the run's lock: a job whose lock another job
   took over (it was stopped past its lease) writes nothing more (`CommitRefused`). Then
   ``manifest.json`` (atomic), then ``COMMITTED`` (atomic; holds the manifest's sha256), then
   replaces ``latest`` (atomic), then applies retention (`retain`: the newest ``keep``, plus
   every checkpoint a rollback may still need, pins.py).

A crash anywhere before step 4's marker leaves a directory without ``COMMITTED``: loaders refuse
it, ``latest`` still names the previous checkpoint, and the next start removes it.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from typing import Callable

import torch
import torch.distributed as dist

from mscale.ckpt import catalog, pins
from mscale.ckpt.catalog import join, write_latest
from mscale.ckpt.limits import MAX_MANIFEST_BYTES
from mscale.ckpt.manifest import (COMMITTED, MANIFEST, MANIFEST_SCHEMA_VERSION, MODEL_ALIAS,
                                  CommitMarker, Manifest, ShardInfo, TensorInfo, TrainState,
                                  manifest_bytes, sha256)
from mscale.ckpt.slices import contains, span
from mscale.errors import MscaleError
from mscale.runs.atomic import write_bytes_atomic


def status(writing: bool, failed: bool, group) -> tuple[int, int]:
    """Ranks still writing and ranks whose write failed, summed over ``group``."""
    flags = torch.tensor([int(writing), int(failed)], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(flags, group=group)
    return int(flags[0]), int(flags[1])


def gather_json(obj, group, dst: int = 0) -> list | None:
    """Gather one JSON-able object per rank to ``dst`` (None elsewhere). JSON bytes in uint8
    tensors: no pickling, and it works on gloo whatever the training backend."""
    raw = gather_raw(obj, group, dst)
    return None if raw is None else decode_gathered(raw)


def gather_raw(obj, group, dst: int = 0) -> list[bytes] | None:
    """`gather_json`'s collective alone: each rank's JSON bytes on ``dst``, not yet decoded, so
    ``dst`` may decode them off the training thread (`decode_gathered`)."""
    data = json.dumps(obj).encode()
    if group is None:
        return [data]
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    me = dist.get_rank()
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if me == dst else None
    dist.gather(buf, out, dst=dst, group=group)
    if me != dst:
        return None
    return [bytes(t[: int(n)].numpy()) for t, n in zip(out, sizes)]


def decode_gathered(raw: list[bytes]) -> list:
    """The objects `gather_raw` gathered, in rank order."""
    return [json.loads(b) for b in raw]


def broadcast_json(obj, group, src: int = 0):
    """Rank ``src``'s object on every rank."""
    if group is None:
        return obj
    data = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = torch.zeros(int(size), dtype=torch.uint8)
    if dist.get_rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()))


def reported_tensors(items) -> dict[str, list]:
    """The tensors a rank names in its report: those whose naming element (`naming_element`) it
    writes. Every element of a checkpoint's tensor is written exactly once, so each tensor is
    named by exactly one rank, and rank 0 gathers a tensor table rather than 12,288 overlapping
    ones. The element is not element 0: that would put a stage's whole table (~300 tensors at
    175B) in the reports of the few ranks holding the first ZeRO shard, and the gather pads every
    rank's report to the largest."""
    return {it.key: [list(it.shape), it.dtype] for it in items if _holds(it, naming_element(it))}


def naming_element(it) -> tuple[int, ...]:
    """The index of the element whose writer names tensor ``it.key``: a position fixed by the
    name alone (crc32, the same on every rank and every run), so that the tensors of a sharded
    stage are named by ranks spread over its shards. A tensor with no element at all (none
    exists today: sizes are validated > 0) is named by the writer of its slice at the origin."""
    if math.prod(it.shape) == 0:
        return tuple(0 for _ in it.shape)
    at = zlib.crc32(it.key.encode()) % math.prod(it.shape)
    index = []
    for n in reversed(it.shape):
        at, i = divmod(at, n)
        index.append(i)
    return tuple(reversed(index))


def _holds(it, index: tuple[int, ...]) -> bool:
    """Whether item ``it`` (a box of its tensor, and a flat range of that box) holds ``index``;
    for an empty tensor, whether it is the slice at the origin."""
    if math.prod(it.shape) == 0:
        return it.flat[0] == 0 and all(a == 0 for a, _ in it.box)
    point = tuple((i, i + 1) for i in index)
    return contains(it.box, point) and it.flat[0] <= span(it.box, point)[0] < it.flat[1]


def build_manifest(step: int, reports: list[dict], *, codec: str, level: int, chunk_bytes: int,
                   layout: dict, plan: dict, state: TrainState,
                   schema_version: int = MANIFEST_SCHEMA_VERSION) -> Manifest:
    """The manifest from every rank's report (``{"shard", "tensors"}``: `reported_tensors`);
    ``model_alias`` is set whenever optimizer master weights are stored (ownership.py).
    ``schema_version`` 1 (reports listing their slices inline) is for bench_manifest.py's
    reference: mscale writes 2."""
    tensors: dict[str, TensorInfo] = {}
    for r in reports:
        for key, (shape, dtype) in r["tensors"].items():
            tensors.setdefault(key, TensorInfo(shape=shape, dtype=dtype))
    shards = sorted((ShardInfo.model_validate(r["shard"]) for r in reports if r.get("shard")),
                    key=lambda s: s.rank)
    alias = MODEL_ALIAS if any(k.startswith(MODEL_ALIAS + "/") for k in tensors) else None
    return Manifest(schema_version=schema_version, step=step, codec=codec, level=level,
                    chunk_bytes=chunk_bytes, layout=layout, plan=plan, state=state,
                    tensors=dict(sorted(tensors.items())), shards=shards, model_alias=alias)


class CommitRefused(Exception):
    """The commit must not be made; the message says why (the run's lock is another job's)."""


def write_commit(ckpt: str, manifest: Manifest) -> None:
    """Manifest first, then the marker naming its sha256 (both atomic). Shards must be durable."""
    raw = manifest_bytes(manifest)
    if len(raw) > MAX_MANIFEST_BYTES:  # committed, it would be refused at every load
        raise ValueError(f"manifest.json would be {len(raw):,} bytes, over the "
                         f"{MAX_MANIFEST_BYTES:,} a loader reads (docs/architecture.md: the "
                         "checkpoint manifest at 12,288 ranks)")
    write_bytes_atomic(join(ckpt, MANIFEST), raw)
    marker = CommitMarker(step=manifest.step, manifest_sha256=sha256(raw))
    write_bytes_atomic(join(ckpt, COMMITTED), marker.model_dump_json().encode())


def retain(ckpt_root: str, keep: int, newest: str) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep`` and uncommitted ones older than
    ``newest`` (dead attempts). Never deletes ``newest``, what ``latest`` names, a pinned
    checkpoint, or the newest one before an open NaN/divergence/spike episode (`pins.protected`:
    a rollback may still need them; they do not count against ``keep``). Returns the names
    removed."""
    keep = max(1, keep)
    found = catalog.entries(ckpt_root, sizes=False)
    try:
        latest = catalog.read_latest(ckpt_root)
    except MscaleError:  # a damaged pointer: keep everything rather than guess what it meant
        return []
    guarded = {newest, latest} | set(pins.protected(ckpt_root, found))
    newest_step = next((e.step for e in found if e.name == newest), None)
    rolling = [e for e in found if e.committed and e.name not in guarded - {newest, latest}]
    doomed = rolling[:-keep] if len(rolling) > keep else []
    if newest_step is not None:
        doomed += [e for e in found if not e.committed and e.step < newest_step]
    removed = []
    for e in doomed:
        if e.name not in guarded:
            catalog.remove(join(ckpt_root, e.name))
            removed.append(e.name)
    return removed


def commit(ckpt_root: str, name: str, manifest: Manifest, keep: int,
           lock_lost: Callable[[], str | None] = lambda: None) -> dict:
    """Rank 0, once every shard is durable: ownership, manifest, marker, ``latest``, retention.

    ``lock_lost()`` is asked first (one small read): a reason raises `CommitRefused` before
    anything is written, so a job that lost the run to another one moves no ``latest`` and
    overwrites no manifest (the new owner may have saved the same step under the same name).
    A lock file that cannot be read (an NFS stale handle, an object store's 503) proves nothing:
    the checkpoint is committed, the error returned as ``lock_check_error``, and the heartbeat
    still watches the lock. Refused, a whole good save was lost to a transient read.

    Retention runs after ``latest`` names the new checkpoint, so its failure (an NFS ``rmtree``
    that meets a reader's ``.nfs`` file, an object store's transient error) is no failure of the
    commit: it is returned as ``retention_error`` and the old checkpoints wait for the next
    commit. Raised, it had the caller remove the checkpoint ``latest`` already named."""
    t0 = time.perf_counter()
    out: dict = {}
    try:
        why = lock_lost()
    except Exception as e:  # noqa: BLE001 - unreadable is no proof of a takeover (below)
        why, out["lock_check_error"] = None, f"{type(e).__name__}: {e}"
    if why:
        raise CommitRefused(why)
    write_commit(join(ckpt_root, name), manifest)
    write_latest(ckpt_root, name)
    out["commit_s"] = time.perf_counter() - t0
    try:
        out["removed"] = retain(ckpt_root, keep, name)
    except Exception as e:  # noqa: BLE001 - reported by the caller; the checkpoint stands
        out["removed"], out["retention_error"] = [], f"{type(e).__name__}: {e}"
    return out
