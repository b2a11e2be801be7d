"""Megatron-LM's indexed token format (MMIDIDX) and flat token files: write one, read any.

Why this format: it is what Megatron-LM's ``tools/preprocess_data.py`` writes, so corpora already
tokenized for Megatron train here unchanged, and ours train there. The layout below was checked
against ``megatron/core/datasets/indexed_dataset.py`` in NVIDIA/Megatron-LM (``_INDEX_HEADER``,
``DType``, ``_IndexWriter.write``, ``IndexedDatasetBuilder``):

- ``PREFIX.bin``: every token, back to back, in the index's dtype.
- ``PREFIX.idx``: ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B`` dtype code, ``<Q`` sequence
  count, ``<Q`` document-index count, then ``int32[sequences]`` lengths, ``int64[sequences]`` byte
  pointers into .bin, ``int64[document-index count]`` document indices: sequence indices of
  document boundaries, a leading 0 then one per document end (``IndexedDatasetBuilder`` starts
  the list at ``[0]`` and appends ``len(sequence_lengths)`` per document).

Our writer puts one sequence per document. Megatron's ``DType`` has no uint32: a vocabulary
over 65,535 is stored as int32 (as Megatron's ``DType.optimal_dtype`` does), bit-identical to
uint32 for every id below 2**31.
"""

from __future__ import annotations

import hashlib
import os
import struct
from array import array
from contextlib import suppress
from types import TracebackType
from typing import Callable

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from mscale.data.storage import Blob, fsync_dir, open_blob
from mscale.errors import MscaleError
from mscale.urls import fs_and_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
"""magic, version, dtype code, sequence count, document-index count: 34 bytes."""
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
"""Megatron-LM's ``DType`` enum: code → numpy dtype (little-endian on disk)."""
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_INT32_MAX = 2**31 - 1
IDENTITY_EDGE_BYTES = 1 << 20
"""A source without a manifest is identified by its size and a checksum of this many bytes of
tokens at its start and at its end (`TokenDataset.identity`)."""


def storage_dtype(dtype: np.dtype | str) -> np.dtype:
    """The dtype tokens are stored in for a requested one: uint32 → int32 (see module doc)."""
    dt = np.dtype(dtype)
    if dt == np.uint32:
        return np.dtype(np.int32)
    if dt not in _CODE_OF or dt.kind not in "iu":
        raise MscaleError(f"token dtype {dt} has no integer code in Megatron's MMIDIDX format",
                          field="dtype", fix="use uint16 (vocabulary ≤ 65,536) or uint32/int32")
    return dt


class IndexedWriter:
    """Writes PREFIX.bin + PREFIX.idx (MMIDIDX v1) atomically: to temporary names, renamed into
    place by close(); abort() removes them.

    A reader that finds PREFIX.idx can trust the pair: .bin is renamed first, .idx last, both
    fsynced, and readers check .bin's size against .idx anyway. Local paths only (a shard is
    written locally, then copied by whoever wants it elsewhere). Also a context manager: close on
    success (call close() inside the block to get its summary), abort on exception.
    """

    def __init__(self, prefix: str, dtype: np.dtype | str) -> None:
        fs, path = fs_and_path(prefix)
        if not isinstance(fs, LocalFileSystem):
            raise MscaleError("IndexedWriter writes local files only", file=str(prefix),
                              fix="write the shard to a local folder, then copy it to the store")
        self.prefix = path
        self.dtype = storage_dtype(dtype)
        self._info = np.iinfo(self.dtype)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        suffix = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp, self._idx_tmp = path + ".bin" + suffix, path + ".idx" + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._sha = hashlib.sha256()
        self._lengths = array("q")  # compact: 8 bytes per document, not a Python int each
        self._tokens = 0
        self._done = False

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document (a 1-D integer array); ids outside the dtype's range are refused."""
        self._append(np.asarray(tokens), None, "a document", "document",
                     "pass the token ids of one document")

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose tokens lie back to back in ``flat``: one range
        check and one write for all, the same bytes as `add_document` for each in turn."""
        arr, n = np.asarray(flat), np.asarray(lengths)
        fix = "pass the documents' token ids back to back, and one length per document"
        if (n.ndim != 1 or (n.size and (n.dtype.kind not in "iu" or int(n.min()) < 0))
                or int(n.sum()) != arr.size):
            raise MscaleError(f"lengths ({n.dtype}{list(n.shape)}) must be integers ≥ 0 that "
                              f"sum to the {arr.size} tokens of flat", file=self.prefix + ".idx",
                              field="lengths", fix=fix)
        self._append(arr, n, "flat", "flat", fix)

    def _append(self, arr: np.ndarray, lengths: np.ndarray | None, what: str, field: str,
                fix: str) -> None:
        """Check and write ``arr``: one document, or (``lengths``) several back to back."""
        if self._done:
            raise ValueError("IndexedWriter is closed")
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise MscaleError(f"{what} must be a 1-D integer array, not {arr.dtype}"
                              f"{list(arr.shape)}", file=self.prefix + ".bin", field=field,
                              fix=fix)
        if arr.size and (int(arr.min()) < self._info.min or int(arr.max()) > self._info.max):
            raise MscaleError(f"token id range [{int(arr.min())}, {int(arr.max())}] does not fit "
                              f"{self.dtype}", file=self.prefix + ".bin", field="dtype",
                              fix="use a wider token dtype (uint32) for this vocabulary")
        longest = arr.size if lengths is None else int(lengths.max(initial=0))
        if longest > _INT32_MAX:  # lengths are int32 in the index
            raise MscaleError(f"a document of {longest} tokens exceeds the int32 length field",
                              file=self.prefix + ".idx", field="sequence_lengths",
                              fix="split the document")
        data = arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self._bin.write(data)
        self._sha.update(data)
        if lengths is None:
            self._lengths.append(arr.size)
        else:
            self._lengths.frombytes(lengths.astype(np.int64).tobytes())
        self._tokens += arr.size

    def _index_bytes(self) -> bytes:
        lengths = np.frombuffer(self._lengths, np.int64) if self._lengths else np.zeros(0, np.int64)
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype="<i8")  # one sequence per document
        head = HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths), len(documents))
        return b"".join((head, lengths.astype("<i4").tobytes(), pointers.tobytes(),
                         documents.tobytes()))

    def close(self) -> dict:
        """Finish both files and rename them into place; returns what a manifest records."""
        if self._done:
            raise ValueError("IndexedWriter is closed")
        try:
            _finish(self._bin)
            idx = self._index_bytes()
            with open(self._idx_tmp, "wb") as f:
                f.write(idx)
                _finish(f)
            os.replace(self._bin_tmp, self.prefix + ".bin")
            os.replace(self._idx_tmp, self.prefix + ".idx")
            fsync_dir(os.path.dirname(self.prefix) or ".")
        except BaseException:
            self.abort()
            raise
        self._done = True
        return {"prefix": os.path.basename(self.prefix), "tokens": self._tokens,
                "documents": len(self._lengths), "bin_sha256": self._sha.hexdigest(),
                "idx_sha256": hashlib.sha256(idx).hexdigest(),
                "bin_bytes": self._tokens * self.dtype.itemsize}

    def abort(self) -> None:
        """Drop the temporary files; nothing appears under PREFIX. Safe to call twice."""
        self._done = True
        if not self._bin.closed:
            self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            with suppress(FileNotFoundError):
                os.remove(tmp)

    def __del__(self) -> None:  # a writer dropped without close() leaves no temp files behind
        if not getattr(self, "_done", True):
            self.abort()

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:  # close() may have been called inside the block for its summary
            self.close() if kind is None else self.abort()


def _finish(f) -> None:
    """Flush, fsync and close: the bytes are on disk before the rename makes them visible."""
    f.flush()
    os.fsync(f.fileno())
    f.close()


# ---------------------------------------------------------------------------------------------
# Reading: every structural fact of an index is checked when it is read, so a bad file is an
# error, never a misread (a prepared folder's are read where needed: datasets.py).
# Checksums are not computed at open (hours for TBs): `verify_dataset` does that on request.


REGENERATE = ("restore the .bin/.idx pair from a copy, or write it again with the tool that made "
              "it (Megatron-LM tools/preprocess_data.py); or tokenize its text anew: mscale data "
              "prepare INPUT... --tokenizer TOKENIZER --out DIR, and train on DIR")
"""The fix for a Megatron pair that does not hold together. `mscale data prepare` reads text
and writes a folder with a manifest: it cannot rebuild a pair in place. A prepared folder's
shards name its own fix (`manifest.REPREPARE`, passed in as ``fix``)."""


def _bad(message: str, file: str, field: str, fix: str) -> MscaleError:
    return MscaleError(message, file=file, field=field, fix=fix)


class Shard:
    """One .bin read through a blob: ``tokens`` tokens of ``dtype``, and (from its .idx) how many
    ``documents`` it holds, or None for a flat file.

    The document start offsets are not kept: 8 bytes a document in every process is ~8 GB at
    10^9 documents, and training needs them only where a held-out split is cut. They are read
    again from the index when asked for (`document_starts`)."""

    def __init__(self, bin_blob: Blob, dtype: np.dtype, documents: int | None = None,
                 index: Callable[[], Blob] | None = None, fix: str = REGENERATE) -> None:
        self.blob, self.dtype, self.documents, self._index = bin_blob, dtype, documents, index
        self.tokens = bin_blob.size // dtype.itemsize
        self.fix = fix
        """What to do when its index, read again, is damaged (`REGENERATE` or a folder's)."""

    def read(self, start: int, stop: int) -> np.ndarray:
        w = self.dtype.itemsize
        raw = self.blob.read(start * w, (stop - start) * w)
        return np.frombuffer(raw, dtype=self.dtype.newbyteorder("<")).astype(np.int64)

    def document_starts(self) -> np.ndarray:
        """Token offsets of this shard's document starts, then ``tokens``: read and checked from
        its .idx again (one read of the index, held only by the caller)."""
        if self._index is None:
            raise ValueError(f"{self.blob.url} is a flat token file: it records no documents")
        idx = self._index()
        dtype, starts = parse_index(idx.read(0, idx.size), idx.url, self.blob.size, self.blob.url,
                                    self.fix)
        if dtype.itemsize != self.dtype.itemsize or len(starts) - 1 != self.documents:
            raise _bad(f"index holds {len(starts) - 1} documents of {dtype}, where the shard was "
                       f"opened as {self.documents} of {self.dtype}", idx.url, "idx", self.fix)
        return starts


def parse_index(idx: bytes, idx_url: str, bin_size: int, bin_url: str,
                fix: str = REGENERATE) -> tuple[np.dtype, np.ndarray]:
    """Check an MMIDIDX index against its .bin's size; returns (dtype, document token offsets).
    ``fix``: what the error says to do (a prepared folder's shard: `manifest.REPREPARE`)."""
    if len(idx) < HEADER.size:
        raise _bad(f"index of {len(idx)} bytes is shorter than its {HEADER.size}-byte header",
                   idx_url, "idx.header", fix)
    magic, version, code, n_seq, n_doc = HEADER.unpack_from(idx)
    if magic != MAGIC:
        raise _bad(f"not an MMIDIDX index (magic {magic!r})", idx_url, "idx.header",
                   "name a Megatron-LM .idx file (a flat token file has no .idx)")
    if version != VERSION:
        raise _bad(f"unknown index version {version} (only 1 exists)", idx_url, "idx.version", fix)
    if code not in DTYPE_CODES or DTYPE_CODES[code].kind not in "iu":
        raise _bad(f"dtype code {code} is not an integer token type of Megatron's DType",
                   idx_url, "idx.dtype", fix)
    dtype = DTYPE_CODES[code]
    expected = HEADER.size + 12 * n_seq + 8 * n_doc
    if len(idx) != expected:
        raise _bad(f"index is {len(idx)} bytes but its counts ({n_seq} sequences, {n_doc} "
                   f"document indices) imply {expected} (truncated, or a multimodal index)",
                   idx_url, "idx.sequence_count", fix)
    off = HEADER.size
    lengths = np.frombuffer(idx, "<i4", n_seq, off).astype(np.int64)
    pointers = np.frombuffer(idx, "<i8", n_seq, off + 4 * n_seq)
    documents = np.frombuffer(idx, "<i8", n_doc, off + 12 * n_seq)
    if n_seq and lengths.min() < 0:
        raise _bad("negative sequence length", idx_url, "idx.sequence_lengths", fix)
    starts = np.zeros(n_seq + 1, dtype=np.int64)  # token offset of each sequence, plus the end
    np.cumsum(lengths, out=starts[1:])
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        i = int(np.argmax(pointers != starts[:-1] * dtype.itemsize))
        raise _bad(f"sequence {i} points to byte {int(pointers[i])}, but the lengths before it "
                   f"put it at {int(starts[i]) * dtype.itemsize}", idx_url,
                   "idx.sequence_pointers", fix)
    if bin_size != int(starts[-1]) * dtype.itemsize:
        raise _bad(f".bin is {bin_size} bytes but the index describes {int(starts[-1])} tokens "
                   f"× {dtype.itemsize} bytes = {int(starts[-1]) * dtype.itemsize}", bin_url,
                   "bin.size", fix)
    if (n_doc == 0 or documents[0] != 0 or documents[-1] != n_seq
            or (n_doc > 1 and np.any(np.diff(documents) < 0))):
        raise _bad(f"document indices must rise from 0 to the sequence count {n_seq}",
                   idx_url, "idx.document_indices", fix)
    return dtype, starts[documents]


def open_prefix(prefix: str, fix: str = REGENERATE, **io) -> Shard:
    """A Megatron prefix: ``prefix.idx`` checked against ``prefix.bin``; ``fix`` as
    `parse_index`'s."""
    bin_blob = open_blob(prefix + ".bin", **io)
    idx_blob = open_blob(prefix + ".idx", **io)
    dtype, starts = parse_index(idx_blob.read(0, idx_blob.size), idx_blob.url, bin_blob.size,
                                bin_blob.url, fix)
    # opened again when asked for: a mapping held per shard is a file descriptor per shard
    return Shard(bin_blob, dtype, len(starts) - 1, lambda: open_blob(prefix + ".idx", **io), fix)


def open_flat(url: str, dtype: np.dtype, **io) -> Shard:
    """A flat token file (nanoGPT's train.bin): raw little-endian ids, no document boundaries."""
    blob = open_blob(url, **io)
    if blob.size % dtype.itemsize:
        raise _bad(f"{blob.size} bytes is not a whole number of {dtype} tokens", url,
                   "flat.size", f"pass the dtype it was written with (not {dtype}), or "
                   "regenerate it")
    return Shard(blob, dtype)


class TokenDataset:
    """One source's token stream: the concatenation of one or more shards."""

    def __init__(self, url: str, shards: list[Shard], vocab_size: int | None = None,
                 eod_id: int | None = None) -> None:
        self.url, self.shards, self.vocab_size, self.eod_id = url, shards, vocab_size, eod_id
        self.dtype: np.dtype = shards[0].dtype
        self._starts = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([s.tokens for s in shards], out=self._starts[1:])
        self.num_tokens = int(self._starts[-1])
        counts = [s.documents for s in shards]
        self.documents: int | None = None if None in counts else sum(counts)
        """Documents in the source; None without document boundaries (a flat file)."""
        if self.num_tokens == 0:
            raise _bad("the dataset holds no tokens", url, "tokens",
                       "name a dataset with data in it")
        self.manifest_digest: str | None = None
        """`manifest.manifest_digest` of a prepared folder; None for other sources."""
        self.tokenizer: str | None = None
        self.tokenizer_sha256: str | None = None
        self.vocab_sha256: str | None = None
        """A prepared folder's tokenizer as its manifest records it (path as given to prepare,
        sha256 of its bytes and of its vocabulary); None for other sources, which record none."""

    def next_document_start(self, pos: int) -> int:
        """The first document start at or after token ``pos`` (``num_tokens`` if none; ``pos``
        itself without document boundaries). Reads the index of the one shard ``pos`` falls in:
        every shard begins with a document, so no other shard can hold the answer."""
        if self.documents is None or pos >= self.num_tokens:
            return min(pos, self.num_tokens)
        i = int(np.searchsorted(self._starts, pos, side="right")) - 1
        base = int(self._starts[i])
        if pos == base:
            return pos
        starts = self.shards[i].document_starts()  # ends with the shard's token count
        return base + int(starts[np.searchsorted(starts, pos - base, side="left")])

    def document_starts(self) -> np.ndarray:
        """Every document start, then ``num_tokens``: every shard's index read and held at once
        (8 bytes a document), for tools and tests; training asks `next_document_start`."""
        if self.documents is None:
            raise ValueError(f"{self.url} records no documents (flat token files)")
        parts = [s.document_starts()[:-1] + base for s, base in zip(self.shards, self._starts)]
        return np.concatenate(parts + [self._starts[-1:]]).astype(np.int64)

    def identity(self) -> dict:
        """What this source holds, cheaply, so a resumed run can tell that it changed under it:
        ``kind`` (``manifest`` or ``edges``), ``digest`` (16 hex digits), ``tokens`` and
        ``documents``. A prepared folder: its manifest's digest (the shards' recorded sha256s; no
        shard is read). Any other source (a Megatron prefix or glob, a flat file): a sha256 of
        its token and document counts and of its first and last `IDENTITY_EDGE_BYTES` of tokens:
        two reads, whatever its size. A change confined to the middle of such a file with the
        same size is not seen (docs/data.md); size and modification time alone would say nothing
        of a file copied over with the same length."""
        if self.manifest_digest is not None:
            kind_, digest = "manifest", self.manifest_digest
        else:
            edge = max(1, IDENTITY_EDGE_BYTES // self.dtype.itemsize)
            h = hashlib.sha256(f"{self.num_tokens}:{self.documents}:".encode())
            h.update(self.read(0, min(edge, self.num_tokens)).tobytes())
            h.update(self.read(max(0, self.num_tokens - edge), self.num_tokens).tobytes())
            kind_, digest = "edges", h.hexdigest()[:16]
        return {"kind": kind_, "digest": digest, "tokens": self.num_tokens,
                "documents": self.documents}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as int64, across shard boundaries."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside {self.url} "
                             f"({self.num_tokens} tokens)")
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        out, pos = [], start
        for i in range(first, len(self.shards)):
            if pos >= stop:
                break
            base = int(self._starts[i])
            end = min(stop, int(self._starts[i + 1]))
            if end > pos:
                out.append(self.shards[i].read(pos - base, end - base))
            pos = end
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
