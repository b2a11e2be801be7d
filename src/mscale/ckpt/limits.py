"""Bounds on what a checkpoint may claim, shared by the writers, the manifest schema, the readers
and the CLI (which imports this module without torch).

Every number a reader seeks to, allocates for or loops over comes from a file that anyone with
write access may have edited, and a checksum proves nothing when whoever changed the manifest
also re-signed it. So each is bounded: far above any real checkpoint, low enough that a tampered
number becomes a named error instead of a MemoryError, a negative read or an hour-long loop.
"""

MIN_LEVEL, MAX_LEVEL = -7, 22
"""zstd levels mscale writes (``--zstd-level`` of train and convert); 0 stores chunks raw."""

DEFAULT_CHUNK_BYTES = 4 << 20
"""4 MiB: small enough that a resharding read wastes little, large enough for full-speed I/O."""
MAX_CHUNK_BYTES = 1 << 28
"""Raw bytes per chunk: 256 MiB, 64x the default; a reader holds one chunk's worth at a time."""
MAX_WORLD = 1 << 20
"""Ranks of a layout (and shards of a checkpoint)."""
MAX_STEP = 1 << 53
MAX_BYTES = 1 << 50
"""A shard file, an offset in it: 1 PiB."""
MAX_NUMEL = 1 << 48
"""Elements of one tensor."""
MAX_NDIM = 8
U32 = (1 << 32) - 1

MAX_MANIFEST_BYTES = 1 << 30
"""The largest manifest.json a loader reads. Since schema 2 it lists shards, not slices: 175B on
12,288 ranks is a few MB (docs/architecture.md; schema 1's inline slices made it ~430 MB). A
commit refuses to write one larger than this rather than leave a checkpoint no loader reads."""
MAX_INDEX_BYTES = 1 << 28
"""The largest shard index (``rank-NNNNN.index.json``): ~35 KB a rank at 175B on 12,288 ranks; a
whole 405B model with its optimizer state in one shard lists ~1.35 million chunks, ~34 MB."""
MAX_SMALL_BYTES = 64 << 10
"""``latest`` and ``COMMITTED`` hold a name, or a hash and a step."""


def max_stored(raw_len: int, codec: str) -> int:
    """The most bytes a chunk of ``raw_len`` raw bytes can take on disk: itself when raw, zstd's
    worst case (ZSTD_COMPRESSBOUND: incompressible data grows by ~1/256 plus a frame) otherwise."""
    if codec == "raw":
        return raw_len
    small = ((128 << 10) - raw_len) >> 11 if raw_len < (128 << 10) else 0
    return raw_len + (raw_len >> 8) + small + 64
