"""The safetensors file format, read and written without the `safetensors` package.

A file is: 8 bytes (little-endian u64) header length N, N bytes of JSON header (padded with
spaces so the data starts 8-byte aligned), then the tensors' raw bytes back to back. The header
maps each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data)
plus an optional ``"__metadata__"`` of strings. Like the reference implementation, `read_header`
refuses a header whose offsets do not tile the data exactly: no gaps, no overlaps, no bytes
pointing outside the file. Nothing is unpickled; tensors are `torch.frombuffer` over the bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable

import torch

from mscale.errors import EXIT_BAD_INPUT, MscaleError

ST_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
            metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    head: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset, sizes = 0, []
    for name, dtype, shape in entries:
        n = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            n *= d
        head[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
        sizes.append(n)
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return raw, sizes


def write(fh: BinaryIO, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
          tensor: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
          after: Callable[[int], None] | None = None) -> int:
    """Write one file; ``tensor(name)`` is called once per entry, in order, so that a caller can
    stream tensors too large to hold all at once, and ``after(nbytes)`` once each is written
    (an export's progress). Returns the bytes written."""
    raw, sizes = _header(entries, metadata)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    total = 8 + len(raw)
    for (name, dtype, shape), size in zip(entries, sizes):
        t = tensor(name).detach().to(dtype).contiguous()
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != declared {shape}")
        if size:
            fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        total += size
        if after is not None:
            after(size)
    return total


def read_header(fh: BinaryIO, source: str) -> tuple[list[Entry], dict[str, str], int]:
    """Entries (sorted by offset), metadata, and the data's start offset in the file."""
    def bad(message: str) -> MscaleError:
        return MscaleError(message, file=source, field="safetensors header", code=EXIT_BAD_INPUT,
                           fix="the file is not a valid safetensors file; re-export it")

    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(0)
    prefix = fh.read(8)
    if len(prefix) != 8:
        raise bad("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > min(MAX_HEADER, size - 8):
        raise bad(f"header length {n} is larger than the file allows")
    try:
        head = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"header is not JSON: {e}")
    if not isinstance(head, dict):
        raise bad("header is not a JSON object")
    meta = head.pop("__metadata__", {}) or {}
    entries = []
    for name, info in head.items():
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"{name}: needs a known dtype, a shape and two data_offsets")
        count = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            count *= d
        if min(shape, default=0) < 0 or end - begin != count:
            raise bad(f"{name}: data_offsets {begin}..{end} do not hold shape {list(shape)}")
        entries.append(Entry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise bad(f"{e.name}: data starts at {e.begin}, expected {pos} (gap or overlap)")
        pos = e.end
    if 8 + n + pos != size:
        raise bad(f"data is {pos} bytes but the file holds {size - 8 - n}")
    return entries, {str(k): str(v) for k, v in meta.items()}, 8 + n


def read_tensor(fh: BinaryIO, entry: Entry, data_start: int) -> torch.Tensor:
    fh.seek(data_start + entry.begin)
    buf = bytearray(entry.end - entry.begin)
    fh.readinto(buf)
    if not buf:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(buf, dtype=entry.dtype).view(entry.shape)
