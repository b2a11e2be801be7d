"""Shard files: tensor bytes cut into fixed-size chunks, each stored raw or as one zstd frame.

Why chunks: a loader at another layout needs a slice of a tensor, not all of it. Each chunk holds
``chunk_bytes`` raw bytes (the last one of a slice fewer) and is compressed on its own, so the
elements ``[lo, hi)`` of a slice cost one ranged read of the chunks that cover them and their
decompression, never the whole file. Each chunk carries a crc32 of its stored bytes (checked on
every read, so a flipped byte is caught at load, not only by `verify`).

The file is nothing but the chunks back to back; the manifest's `SliceInfo` lists them. Bytes are
the tensor's memory as is (little-endian), so `torch.frombuffer` rebuilds it: nothing is parsed.
"""

from __future__ import annotations

import struct
from concurrent.futures import Executor, Future
from functools import cache
from typing import TYPE_CHECKING, BinaryIO, Iterator

import zstandard

from mscale.ckpt.manifest import ELEMENT_TYPES, SliceInfo, itemsize

if TYPE_CHECKING:
    import torch
# torch is imported where a tensor is made, not here: `ckpt verify`, `ckpt ls` and `recover`
# check chunks and checksums only, and importing torch cost recover's diagnosis ~1.1 s of its 2.


@cache
def _dtypes() -> dict[str, "torch.dtype"]:
    import torch

    return {name: getattr(torch, name) for name in ELEMENT_TYPES}


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype of an element type a manifest names (`manifest.ELEMENT_TYPES`)."""
    return _dtypes()[name]

try:  # the same crc32, ~10x faster (ISA-L, carry-less multiply): 19 GB/s against zlib's 2.2 here
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives identical values
    from zlib import crc32



class ChunkError(ValueError):
    """A chunk whose bytes do not match the manifest (checksum, size, or decoding)."""


def _at(where: str, what: str) -> str:
    """``where: what``, or ``what`` alone: callers that already name the file pass no ``where``."""
    return f"{where}: {what}" if where else what


def _chunk(where: str, i: int) -> str:
    return f"{where} chunk {i}" if where else f"chunk {i}"


def dtype_name(dtype: "torch.dtype") -> str:
    """The manifest's element type of a torch dtype (`torch_dtype` backwards)."""
    return next(name for name, d in _dtypes().items() if d == dtype)


class Encoder:
    """Cuts byte strings into chunks and encodes them; one per writer thread (zstd contexts are
    not shared between threads)."""

    def __init__(self, codec: str, level: int, chunk_bytes: int):
        if codec not in ("raw", "zstd"):
            raise ValueError(f"unknown codec {codec!r}")
        self.codec, self.level, self.chunk_bytes = codec, level, chunk_bytes
        self._zstd = zstandard.ZstdCompressor(level=level) if codec == "zstd" else None

    def encode(self, raw: memoryview) -> tuple[bytes | memoryview, int]:
        """One chunk: ``(stored bytes, crc32 of them)``."""
        stored = self._zstd.compress(raw) if self._zstd else raw
        return stored, crc32(stored)

    def chunks(self, data: memoryview) -> Iterator[memoryview]:
        for start in range(0, len(data), self.chunk_bytes):
            yield data[start: start + self.chunk_bytes]


def write_slice(fh: BinaryIO, encoder: Encoder, data: memoryview, on_chunk=None,
                pool: Executor | None = None) -> list[list[int]]:
    """Write ``data`` as chunks to ``fh``; return the chunk table ``[[stored_bytes, crc32]]``.

    With ``pool`` (one worker thread) the next chunk is compressed and checksummed while this
    one is written: zstd, crc32 and file writes all release the GIL, so encoding and I/O
    overlap. ``on_chunk`` (the writer's `WriteHooks`) is called after each chunk is written."""
    table = []
    pending = None
    for raw in encoder.chunks(data):
        job = pool.submit(encoder.encode, raw) if pool else None
        if pending is not None:
            _write_one(fh, pending, table, on_chunk)
        pending = job if job is not None else encoder.encode(raw)
    if pending is not None:
        _write_one(fh, pending, table, on_chunk)
    return table


def _write_one(fh: BinaryIO, pending, table: list, on_chunk) -> None:
    stored, crc = pending.result() if isinstance(pending, Future) else pending
    fh.write(stored)
    table.append([len(stored), crc])
    if on_chunk:
        on_chunk()


def shard_checksum(crcs: list[int]) -> str:
    """The per-shard checksum: crc32 over the chunks' crc32s (little-endian u32) in file order."""
    return f"crc32-chunks:{crc32(struct.pack(f'<{len(crcs)}I', *crcs)):08x}"


class Decoder:
    """Reads elements of a slice: one ranged read of the covering chunks, crc check, decode."""

    def __init__(self, codec: str, chunk_bytes: int):
        self.codec, self.chunk_bytes = codec, chunk_bytes
        self._zstd = zstandard.ZstdDecompressor() if codec == "zstd" else None

    def check(self, stored: memoryview, crc: int, where: str) -> None:
        if crc32(stored) != crc:
            raise ChunkError(_at(where, "checksum mismatch"))

    def decode(self, stored: memoryview, crc: int, raw_len: int, where: str) -> bytes | memoryview:
        """One chunk's raw bytes, after checking its crc and length."""
        self.check(stored, crc, where)
        if self._zstd is None:
            out = stored
        else:
            try:
                out = self._zstd.decompress(stored, max_output_size=raw_len)
            except zstandard.ZstdError as e:
                raise ChunkError(_at(where, f"zstd frame does not decode ({e})")) from None
        if len(out) != raw_len:
            raise ChunkError(_at(where, f"decodes to {len(out)} bytes, expected {raw_len}"))
        return out

    def raw_lengths(self, s: SliceInfo, item: int) -> list[int]:
        total = s.count * item
        return [min(self.chunk_bytes, total - i * self.chunk_bytes) for i in range(len(s.chunks))]

    def read(self, fh: BinaryIO, s: SliceInfo, dtype: str, lo: int, hi: int,
             where: str = "") -> "torch.Tensor":
        """Elements ``[lo, hi)`` of the slice's data (0 = its first element) as a 1-D tensor."""
        import torch

        item = itemsize(dtype)
        if hi <= lo:
            return torch.empty(0, dtype=torch_dtype(dtype))
        per = self.chunk_bytes // item
        c0, c1 = lo // per, (hi - 1) // per
        raw_lens = self.raw_lengths(s, item)
        fh.seek(s.offset + sum(c[0] for c in s.chunks[:c0]))
        blob = bytearray(sum(c[0] for c in s.chunks[c0:c1 + 1]))
        got = fh.readinto(blob)
        if got != len(blob):
            raise ChunkError(_at(where, f"file ends {len(blob) - (got or 0)} bytes early"))
        view, pos = memoryview(blob), 0
        skip = (lo - c0 * per) * item
        if self._zstd is None:  # raw: check the chunks, then hand out the read buffer itself
            for i in range(c0, c1 + 1):
                stored_len, crc = s.chunks[i]
                if stored_len != raw_lens[i]:
                    raise ChunkError(_at(_chunk(where, i), f"{stored_len} bytes stored, "
                                         f"{raw_lens[i]} expected"))
                self.check(view[pos: pos + stored_len], crc, _chunk(where, i))
                pos += stored_len
            return torch.frombuffer(blob, dtype=torch_dtype(dtype), count=hi - lo,
                                        offset=skip)
        out = bytearray((hi - lo) * item)
        dst, filled = memoryview(out), 0
        for i in range(c0, c1 + 1):
            stored_len, crc = s.chunks[i]
            raw = memoryview(self.decode(view[pos: pos + stored_len], crc, raw_lens[i],
                                         _chunk(where, i)))
            pos += stored_len
            piece = raw[skip: skip + len(out) - filled]
            dst[filled: filled + len(piece)] = piece
            filled, skip = filled + len(piece), 0
        return torch.frombuffer(out, dtype=torch_dtype(dtype))

    def read_whole(self, fh: BinaryIO, s: SliceInfo, out: "torch.Tensor",
                   where: str = "") -> None:
        """All of a slice, decoded straight into ``out`` (contiguous, ``s.count`` elements): the
        same-layout load path, one copy from the file instead of two."""
        import torch

        dst = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        lens = self.raw_lengths(s, out.element_size())
        fh.seek(s.offset)
        if self._zstd is None:
            if [c[0] for c in s.chunks] != lens:
                raise ChunkError(_at(where, "stored chunk sizes do not match the slice"))
            got = fh.readinto(dst)
            if got != len(dst):
                raise ChunkError(_at(where, f"file ends {len(dst) - (got or 0)} bytes early"))
            pos = 0
            for i, (stored_len, crc) in enumerate(s.chunks):
                self.check(dst[pos: pos + stored_len], crc, _chunk(where, i))
                pos += stored_len
            return
        blob = bytearray(s.stored_bytes)
        if fh.readinto(blob) != len(blob):
            raise ChunkError(_at(where, "file ends early"))
        view, pos, filled = memoryview(blob), 0, 0
        for i, (stored_len, crc) in enumerate(s.chunks):
            raw = self.decode(view[pos: pos + stored_len], crc, lens[i], _chunk(where, i))
            dst[filled: filled + lens[i]] = raw
            pos, filled = pos + stored_len, filled + lens[i]


