"""indexed: Megatron MMIDIDX files (from an independent reference writer, folders.py, and from
IndexedWriter) read token-exact and bounds-checked; the writer's round trip, atomicity and limits;
every malformed index refused with the file and field named. The other sources and manifest
folders: test_datasets.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mscale.data.datasets import open_dataset
from mscale.data.indexed import IndexedWriter
from mscale.errors import MscaleError

from tests.unit.data.folders import CODES, DOCS, FLAT, STARTS, reference_write, refused


# ------------------------------------------------------------------ reading what Megatron writes


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_reference_files_read_back_token_exact(tmp_path, dtype):
    reference_write(tmp_path / "corpus", DOCS, dtype)
    for spec in ("corpus", "corpus.idx", "corpus.bin"):
        ds = open_dataset(str(tmp_path / spec))
        assert ds.dtype == np.dtype(dtype) and ds.num_tokens == len(FLAT)
        assert ds.read(0, ds.num_tokens).tolist() == FLAT
        assert ds.read(3, 6).dtype == np.int64 and ds.read(3, 6).tolist() == FLAT[3:6]
        assert ds.document_starts().tolist() == STARTS
        assert ds.vocab_size is None and ds.eod_id is None


def test_read_is_bounds_checked(tmp_path):
    reference_write(tmp_path / "c", DOCS)
    ds = open_dataset(str(tmp_path / "c"))
    assert ds.read(5, 5).tolist() == []
    for start, stop in ((-1, 2), (3, 2), (0, len(FLAT) + 1)):
        with pytest.raises(IndexError):
            ds.read(start, stop)


def test_writer_round_trip_and_summary(tmp_path):
    with IndexedWriter(str(tmp_path / "out" / "shard-00000"), "uint16") as w:
        for d in DOCS:
            w.add_document(np.array(d, dtype=np.int64))
    w = IndexedWriter(str(tmp_path / "s1"), "uint32")
    w.add_document(np.array([70000, 0]))
    info = w.close()
    assert info["prefix"] == "s1" and info["tokens"] == 2 and info["documents"] == 1
    assert info["bin_bytes"] == 8
    assert (tmp_path / "s1.idx").read_bytes()[17] == CODES["int32"]  # Megatron has no uint32 code
    assert info["bin_sha256"] == hashlib.sha256((tmp_path / "s1.bin").read_bytes()).hexdigest()
    assert info["idx_sha256"] == hashlib.sha256((tmp_path / "s1.idx").read_bytes()).hexdigest()
    assert open_dataset(str(tmp_path / "s1")).read(0, 2).tolist() == [70000, 0]
    ds = open_dataset(str(tmp_path / "out" / "shard-00000"))
    assert ds.read(0, ds.num_tokens).tolist() == FLAT and ds.document_starts().tolist() == STARTS
    # byte-identical to the reference layout: the writer and the format description agree
    reference_write(tmp_path / "ref", DOCS)
    for ext in (".bin", ".idx"):
        ours, ref = tmp_path / f"out/shard-00000{ext}", tmp_path / f"ref{ext}"
        assert ours.read_bytes() == ref.read_bytes()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_add_documents_writes_the_bytes_of_add_document_one_by_one(tmp_path, dtype):
    rng = np.random.default_rng(7)
    top = 65_535 if dtype == "uint16" else 2**31 - 1
    docs = [rng.integers(0, top, int(n), endpoint=True) for n in rng.integers(0, 50, 200)]
    docs[0] = np.zeros(0, np.int64)  # an empty document is a document too
    one = IndexedWriter(str(tmp_path / "one"), dtype)
    for d in docs:
        one.add_document(d)
    bulk = IndexedWriter(str(tmp_path / "bulk"), dtype)
    for a, b in ((0, 1), (1, 1), (1, 120), (120, 200)):  # runs of 1, 0 and many documents
        bulk.add_documents(np.concatenate([np.zeros(0, np.int64)] + docs[a:b]),
                           np.array([d.size for d in docs[a:b]], dtype=np.int64))
    info_one, info_bulk = one.close(), bulk.close()
    assert {**info_one, "prefix": "bulk"} == info_bulk
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"bulk{ext}").read_bytes()
    ds = open_dataset(str(tmp_path / "bulk"))
    assert ds.document_starts().tolist() == np.cumsum([0] + [d.size for d in docs]).tolist()


def test_add_documents_refuses_lengths_that_do_not_match(tmp_path):
    w = IndexedWriter(str(tmp_path / "s"), "uint16")
    for flat, lengths, field in (([1, 2, 3], [1, 1], "lengths"), ([1, 2], [3, -1], "lengths"),
                                 ([1, 2], [[1, 1]], "lengths"), ([1, 2], [1.0, 1.0], "lengths"),
                                 ([1, 65536], [1, 1], "dtype"), ([[1, 2]], [2], "flat")):
        with pytest.raises(MscaleError) as e:
            w.add_documents(np.array(flat), np.array(lengths))
        assert e.value.field == field, str(e.value)
    w.add_documents(np.array([1, 2, 3]), np.array([2, 1]))
    assert w.close()["documents"] == 2  # nothing of the refused calls was written
    assert open_dataset(str(tmp_path / "s")).read(0, 3).tolist() == [1, 2, 3]


def test_writer_is_atomic(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(str(tmp_path / "s"), "uint16") as w:
            w.add_document(np.array([1, 2]))
            raise RuntimeError("tokenizer crashed")
    assert list(tmp_path.iterdir()) == []  # aborted: no file, temporary or final
    w = IndexedWriter(str(tmp_path / "s"), "uint16")
    w.add_document(np.array([1]))
    assert not (tmp_path / "s.idx").exists() and not (tmp_path / "s.bin").exists()
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx"]


def test_writer_refuses_what_does_not_fit(tmp_path):
    w = IndexedWriter(str(tmp_path / "s"), "uint16")
    for bad in (np.array([65536]), np.array([-1]), np.array([1.5]), np.zeros((2, 2), int)):
        with pytest.raises(MscaleError):
            w.add_document(bad)
    w.abort()
    with pytest.raises(MscaleError, match="no integer code"):
        IndexedWriter(str(tmp_path / "t"), "float32")
    with pytest.raises(MscaleError, match="local files only"):
        IndexedWriter("memory://x/s", "uint16")


# -------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("override", "field"), [
    ({"magic": b"MMIDIDY\x00\x00"}, "idx.header"),
    ({"version": 2}, "idx.version"),
    ({"code": 9}, "idx.dtype"),
    ({"code": 7}, "idx.dtype"),  # float32: not a token type
    ({"pointers": [0, 6, 100, 18]}, "idx.sequence_pointers"),
    ({"doc_index": [0, 3, 2, 4]}, "idx.document_indices"),
    ({"doc_index": [0, 2, 3]}, "idx.document_indices"),  # does not end at the sequence count
    ({"doc_index": [1, 2, 3, 4]}, "idx.document_indices"),
    ({"seq_lens": [3, 1, 5, -2]}, "idx.sequence_lengths"),
])
def test_malformed_index_is_refused(tmp_path, override, field):
    reference_write(tmp_path / "c", DOCS, **override)
    refused(str(tmp_path / "c"), field, str(tmp_path / "c.idx"))


def test_truncated_index_and_wrong_bin_size(tmp_path):
    reference_write(tmp_path / "c", DOCS)
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(idx[:-8])
    refused(str(tmp_path / "c"), "idx.sequence_count", str(tmp_path / "c.idx"))
    (tmp_path / "c.idx").write_bytes(idx[:20])
    refused(str(tmp_path / "c"), "idx.header", str(tmp_path / "c.idx"))
    (tmp_path / "c.idx").write_bytes(idx)
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-2])
    refused(str(tmp_path / "c"), "bin.size", str(tmp_path / "c.bin"))
