"""Token files and folders for tests: Megatron's .bin/.idx written from its description
(`reference_write`), folders as `mscale data prepare` writes them (`prepared`, `write_manifest`),
and `refused`, a source opened and refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mscale.data.datasets import open_dataset
from mscale.data.indexed import IndexedWriter
from mscale.errors import MscaleError


def prepared(folder, docs, **extra):
    """A folder as `mscale data prepare` writes it (IndexedWriter + manifest.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    with IndexedWriter(str(folder / "shard-00000"), np.uint16) as w:
        for d in docs:
            w.add_document(np.asarray(d))
        info = w.close()
    (folder / "manifest.json").write_text(json.dumps({
        "format": "mscale-tokens", "version": 1, "tokenizer": "t.json", "vocab_size": 300,
        "eod_id": 0, "dtype": "uint16", "tokens": info["tokens"],
        "documents": info["documents"], "shards": [{**info, "prefix": "shard-00000"}], **extra}))


CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7,
         "uint16": 8}


def reference_write(prefix: Path, docs: list[list[int]], dtype: str = "uint16", *,
                    magic: bytes = b"MMIDIDX\x00\x00", version: int = 1, code: int | None = None,
                    doc_index: list[int] | None = None, pointers: list[int] | None = None,
                    seq_lens: list[int] | None = None) -> None:
    """Megatron's layout written from its description with plain struct.pack, one sequence per
    document; keyword overrides corrupt one field at a time."""
    width = np.dtype(dtype).itemsize
    lens = seq_lens if seq_lens is not None else [len(d) for d in docs]
    ptrs = pointers if pointers is not None else [sum(lens[:i]) * width for i in range(len(lens))]
    index = doc_index if doc_index is not None else list(range(len(docs) + 1))
    prefix.with_suffix(".bin").write_bytes(
        b"".join(struct.pack(f"<{len(d)}{'H' if width == 2 else 'i'}", *d) for d in docs))
    head = magic + struct.pack("<QBQQ", version, CODES[dtype] if code is None else code,
                               len(lens), len(index))
    body = (struct.pack(f"<{len(lens)}i", *lens) + struct.pack(f"<{len(ptrs)}q", *ptrs)
            + struct.pack(f"<{len(index)}q", *index))
    prefix.with_suffix(".idx").write_bytes(head + body)


DOCS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]


FLAT = [t for d in DOCS for t in d]


STARTS = [0, 3, 4, 9, 11]  # document token offsets, plus the end


def refused(spec: str, field: str | None, file: str, **kw) -> MscaleError:
    with pytest.raises(MscaleError) as e:
        open_dataset(spec, **kw)
    assert e.value.field == field, str(e.value)
    assert e.value.file == file, str(e.value)
    return e.value


def write_manifest(folder: Path, docs_per_shard: list[list[list[int]]], **override) -> dict:
    """A manifest folder as `mscale data prepare` writes it, through IndexedWriter."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, docs in enumerate(docs_per_shard):
        w = IndexedWriter(str(folder / f"shard-{i:05d}"), "uint16")
        for d in docs:
            w.add_document(np.array(d))
        entries.append(w.close())
    m = {"format": "mscale-tokens", "version": 1, "tokenizer": "tok.json", "vocab_size": 100,
         "eod_id": 0, "dtype": "uint16", "tokens": sum(e["tokens"] for e in entries),
         "documents": sum(e["documents"] for e in entries), "shards": entries, **override}
    (folder / "manifest.json").write_text(json.dumps(m))
    return m
