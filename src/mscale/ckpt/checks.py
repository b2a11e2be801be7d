"""What a manifest's fields must agree on, beyond each field's own bounds (manifest.py).

Readers index, seek and allocate by what the manifest says: a chunk table of the wrong length, a
slice outside its tensor or a chunk "of 2^46 bytes" would otherwise become an IndexError, a
negative read or a MemoryError deep inside a load. So `parse_manifest` runs `check_manifest`
before returning: after it, every slice lies inside its tensor and its shard's recorded size,
every chunk is no longer than the chunk size allows, and the step, layout and plan agree.
What is left for `verify` is what needs the whole picture or the files: that slices tile each
shard, that every element is stored exactly once, and the bytes themselves. The shard's real
size is checked where it is opened (`files.open_shard`), so no read goes past it. A schema-2
shard's slices are checked the same way when its index file is read (`parse_index`).
"""

from __future__ import annotations

from mscale.ckpt import untrusted
from mscale.ckpt.limits import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, U32, max_stored
from mscale.ckpt.manifest import (MANIFEST, MASTER_DTYPE, TENSOR_KEY, ClipState, LayoutRecord,
                                  Manifest, ShardIndex, ShardInfo, SliceInfo, itemsize, sha256,
                                  strict_record)
from mscale.ckpt.untrusted import DAMAGED
from mscale.config.base import validate
from mscale.config.plan import Plan
from mscale.errors import EXIT_CRITICAL, MscaleError


def _bad(source: str, field: str, message: str) -> MscaleError:
    return MscaleError(message, file=source, field=field, code=EXIT_CRITICAL, fix=DAMAGED)


def check_manifest(m: Manifest, plan, source: str) -> None:
    """Raise an MscaleError (exit 2) naming the first field that disagrees."""
    if m.state.step != m.step:
        raise _bad(source, "state.step", f"state says step {m.state.step}, the manifest {m.step}")
    lo = plan.layout
    want = {"tp": lo.tp, "pp": lo.pp, "dp": lo.dp, "vpp": lo.vpp, "zero_stage": lo.zero_stage,
            "world": lo.world_size}
    if m.layout != want:
        raise _bad(source, "layout", f"{m.layout} disagrees with the plan's layout {want}")
    world = want["world"]
    if m.state.rng_world not in (None, world):
        raise _bad(source, "state.rng_world", f"{m.state.rng_world}, but the layout has {world} "
                   "ranks")
    for key, info in m.tensors.items():
        if not TENSOR_KEY.match(key):
            raise _bad(source, "tensors", f"{key[:80]!r} is not a tensor key (group/name)")
        if key.startswith("optim.") and info.dtype != MASTER_DTYPE:
            raise _bad(source, f"tensors.{key}.dtype", f"optimizer state is {MASTER_DTYPE}, "
                       f"not {info.dtype}")
    ranks: set[int] = set()
    for i, shard in enumerate(m.shards):
        if shard.rank >= world or shard.rank in ranks:
            raise _bad(source, f"shards[{i}].rank", f"rank {shard.rank} is outside the {world} "
                       "ranks of the layout or written twice")
        ranks.add(shard.rank)
        for j, s in enumerate(shard.slices):
            _check_slice(m, s, shard.bytes, source, f"shards[{i}].slices[{j}]")


def raw_lengths(nbytes: int, chunk_bytes: int) -> list[int]:
    """Raw bytes of each chunk of a slice of ``nbytes`` bytes."""
    return [min(chunk_bytes, nbytes - start) for start in range(0, nbytes, chunk_bytes)]


def _check_slice(m: Manifest, s: SliceInfo, file_bytes: int, source: str, where: str) -> None:
    info = m.tensors.get(s.tensor)
    if info is None:
        raise _bad(source, f"{where}.tensor", f"unknown tensor {s.tensor[:80]!r}: "
                   f"{MANIFEST} lists no such tensor")
    if len(s.box) != len(info.shape) or not all(
            0 <= a < b <= d for (a, b), d in zip(s.box, info.shape)):
        raise _bad(source, f"{where}.box", f"{s.box} is not inside {s.tensor}'s shape "
                   f"{info.shape}")
    n = 1
    for a, b in s.box:
        n *= b - a
    lo, hi = s.flat
    if not lo < hi <= n:
        raise _bad(source, f"{where}.flat", f"{s.flat} is not inside its box of {n} elements")
    nbytes = (hi - lo) * itemsize(info.dtype)
    if len(s.chunks) != -(-nbytes // m.chunk_bytes):
        raise _bad(source, f"{where}.chunks", f"{len(s.chunks)} chunks for {nbytes} bytes of "
                   f"{m.chunk_bytes}-byte chunks")
    for k, ((stored, crc), raw) in enumerate(zip(s.chunks, raw_lengths(nbytes, m.chunk_bytes))):
        limit = max_stored(raw, m.codec)
        if not (stored == raw if m.codec == "raw" else 0 < stored <= limit):
            raise _bad(source, f"{where}.chunks[{k}]", f"{stored} bytes stored for {raw} raw "
                       f"bytes; a {m.codec} chunk of that size takes "
                       + (f"exactly {raw}" if m.codec == "raw" else f"1 to {limit}"))
        if crc > U32:
            raise _bad(source, f"{where}.chunks[{k}]", f"crc32 {crc} does not fit in 32 bits")
    if s.offset + s.stored_bytes > file_bytes:
        raise _bad(source, f"{where}.offset", f"its chunks end at byte "
                   f"{s.offset + s.stored_bytes}, beyond the shard's {file_bytes} bytes")


def parse_index(data: bytes, source: str, m: Manifest, shard: ShardInfo) -> list[SliceInfo]:
    """A schema-2 shard's slices from its index file's bytes, checked as `check_manifest` checks
    inline ones: the bytes are the ones the (committed) manifest names by sha256, the index
    names this shard, and every slice lies inside its tensor and the shard."""
    if shard.index is None:
        raise _bad(source, "index", "the manifest names no index for this shard")
    if sha256(data) != shard.index.sha256:
        raise _bad(source, None, "sha256 differs from the one the manifest records for it "
                   "(changed or replaced after the commit)")
    raw = untrusted.load_json(data, source, "shard index", MAX_INDEX_BYTES)
    index = strict_record(ShardIndex, raw, source)
    if index.shard != shard.path or index.rank != shard.rank:
        raise _bad(source, "shard", f"describes {index.shard} of rank {index.rank}, not "
                   f"{shard.path} of rank {shard.rank}")
    for j, s in enumerate(index.slices):
        _check_slice(m, s, shard.bytes, source, f"slices[{j}]")
    return index.slices


def parse_manifest(data: bytes, source: str) -> Manifest:
    """Parse manifest bytes, checking everything before any of it is used: the JSON's size and
    depth (untrusted.py), the schema and its bounds (strict), the embedded layout, clip state
    and plan, and that every slice and chunk is consistent with them (`check_manifest`). A
    malformed manifest is a failed check (exit 2) naming the field."""
    raw = untrusted.load_json(data, source, "manifest", MAX_MANIFEST_BYTES)
    m = strict_record(Manifest, raw, source)
    strict_record(LayoutRecord, m.layout, source, "layout.")
    if m.state.clip:
        strict_record(ClipState, m.state.clip, source, "state.clip.")
    try:
        plan = validate(Plan, m.plan, source, prefix="plan.")
    except MscaleError as e:
        e.code, e.fix = EXIT_CRITICAL, DAMAGED
        raise
    check_manifest(m, plan, source)
    return m
