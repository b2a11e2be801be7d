"""Compact per-rank vectors for metrics records (schema version 2).

A version-1 record carries each per-rank vector as a JSON list of floats: ~20 bytes a value, so
the eight vectors at 12,288 ranks are ~1.9 MB a step, written by rank 0 every step
(bench/bench_watch.py measures it). Version 2 may carry a vector as one small JSON object instead:

    {"dtype": "<i8", "scale": 1e-06, "codec": "shuffle+zstd", "data": "<base64>"}

- ``data``: standard base64 of the array's bytes, after ``codec``;
- ``dtype``: little-endian ``<f4``, ``<f8``, ``<i4`` or ``<i8``; the value of element ``r`` is
  ``stored[r] * scale`` (``scale`` defaults to 1); in an integer array the dtype's minimum
  stands for a missing, non-finite or out-of-range value (NaN), since integers have no NaN;
- ``codec``: ``none`` (the default), ``zstd``, or ``shuffle+zstd``: the array's bytes grouped by
  byte position (all first bytes, then all second bytes, ...) before zstd, which lets zstd
  squeeze the near-constant high bytes of similar numbers.

mscale writes microseconds as ``<i8`` with ``shuffle+zstd`` (1 µs resolution, ~10x smaller than
JSON text at 12,288 ranks); another trainer can write the simplest form,
``{"dtype": "<f4", "data": ...}``. Both the writer (train, config) and the reader (watch) use this
module, so it sits in ``config``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Sequence

import numpy as np
import zstandard

from mscale.errors import MscaleError

COMPACT_MIN_RANKS = 1024
"""Worlds of this many ranks or more get schema-2 records; smaller ones stay version 1, plain JSON
lists that any tool reads (a v1 record of 1,023 ranks is ~100 kB)."""
MAX_RANKS = 1 << 22
"""Largest vector a reader accepts: bounds what a hostile record can make us allocate."""
DTYPES = ("<f4", "<f8", "<i4", "<i8")
CODECS = ("none", "zstd", "shuffle+zstd")
WRITE_DTYPE, WRITE_SCALE, WRITE_CODEC = "<i8", 1e-6, "shuffle+zstd"
"""What mscale's writer uses: microseconds as 64-bit integers (no range to outgrow)."""
_KEYS = frozenset({"dtype", "scale", "codec", "data"})
_FIX = "write the vector as a JSON list, or as docs/watch.md#metrics-schema describes"


def is_encoded(value: Any) -> bool:
    """Whether a record's vector field holds an encoded object rather than a JSON list."""
    return isinstance(value, dict)


def encode_vector(values: Sequence[float] | np.ndarray, dtype: str = WRITE_DTYPE,
                  scale: float = WRITE_SCALE, codec: str = WRITE_CODEC) -> dict[str, Any]:
    """One per-rank vector as a schema-2 object (module docstring)."""
    if dtype not in DTYPES or codec not in CODECS:
        raise ValueError(f"dtype {dtype!r} / codec {codec!r} not in {DTYPES} / {CODECS}")
    x = np.asarray(values, dtype=np.float64) / scale
    kind = np.dtype(dtype)
    if kind.kind == "i":
        bad = ~np.isfinite(x) | (np.abs(x) >= 2.0 ** (8 * kind.itemsize - 1))
        x = np.where(bad, np.iinfo(kind).min, np.rint(np.where(bad, 0, x))).astype(kind)
    else:
        x = x.astype(kind)
    raw = x.tobytes()
    if codec == "shuffle+zstd":
        raw = _shuffle(raw, kind.itemsize)
    if codec != "none":
        raw = zstandard.ZstdCompressor(level=3).compress(raw)
    out: dict[str, Any] = {"dtype": dtype}
    if scale != 1:
        out["scale"] = scale
    if codec != "none":
        out["codec"] = codec
    out["data"] = base64.b64encode(raw).decode("ascii")
    return out


def decode_vector(obj: Any, world: int | None = None, field: str = "vector") -> np.ndarray:
    """A schema-2 object back to ``[world]`` float64 (NaN where the writer had none).

    Raises MscaleError naming ``field`` for anything malformed, including a vector whose length
    is not ``world`` (when given)."""
    if not isinstance(obj, dict) or "data" not in obj or not set(obj) <= _KEYS:
        raise MscaleError(f"an encoded vector needs 'data' and only {sorted(_KEYS)}",
                          field=field, fix=_FIX)
    dtype, codec, scale = obj.get("dtype", "<f4"), obj.get("codec", "none"), obj.get("scale", 1)
    if dtype not in DTYPES or codec not in CODECS:
        raise MscaleError(f"unknown dtype {dtype!r} or codec {codec!r} (known: {DTYPES}, "
                          f"{CODECS})", field=field, fix=_FIX)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise MscaleError(f"scale must be a number, not {scale!r}", field=field, fix=_FIX)
    kind = np.dtype(dtype)
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise MscaleError("'data' is not base64", field=field, fix=_FIX) from None
    if codec != "none":
        raw = _unzstd(raw, MAX_RANKS * kind.itemsize, field)
    if len(raw) % kind.itemsize or len(raw) // kind.itemsize > MAX_RANKS:
        raise MscaleError(f"{len(raw)} bytes is not a whole {dtype} vector of at most "
                          f"{MAX_RANKS:,} ranks", field=field, fix=_FIX)
    if codec == "shuffle+zstd":
        raw = _shuffle(raw, kind.itemsize, inverse=True)
    stored = np.frombuffer(raw, dtype=kind)
    if world is not None and len(stored) != world:
        raise MscaleError(f"has {len(stored)} ranks, the job has {world}", field=field,
                          fix="every per-rank vector of a run must have one value per rank")
    out = stored.astype(np.float64)
    if kind.kind == "i":
        out[stored == np.iinfo(kind).min] = np.nan
    if scale != 1:
        out *= scale
    return out


def _shuffle(raw: bytes, itemsize: int, inverse: bool = False) -> bytes:
    """Group bytes by position within each element (or undo it)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    shape = (itemsize, -1) if inverse else (-1, itemsize)
    return b.reshape(shape).T.tobytes()


def _unzstd(raw: bytes, limit: int, field: str) -> bytes:
    """Decompress one zstd frame whose declared size is at most ``limit`` (no zip bombs)."""
    try:
        size = zstandard.frame_content_size(raw)
        if size < 0 or size > limit:
            raise MscaleError(f"zstd frame declares {size} bytes (must state its size, at most "
                              f"{limit:,})", field=field, fix=_FIX)
        return zstandard.ZstdDecompressor().decompress(raw)
    except zstandard.ZstdError as e:
        raise MscaleError(f"'data' is not a zstd frame ({e})", field=field, fix=_FIX) from None
