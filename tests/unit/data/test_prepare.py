"""mscale.data.prepare: text in input order → shards with EOD after every document, the same
bytes for any worker count, shards rolled without splitting a document, fsspec URLs and globs,
progress. Bad input: test_prepare_refusals.py."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from mscale.data import prepare as prep
from mscale.data.datasets import open_dataset, verify_dataset
from mscale.data.prepare import prepare
from mscale.data.tokenizer import load_tokenizer, vocab_sha256
from mscale.errors import MscaleError

from tests.unit.data.corpus_text import decoded, docs_of, text, write_jsonl


def test_txt_files_are_one_document_each_in_input_order(tokenizer, tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text(text(2))
    (src / "a.txt").write_text(text(1))
    (src / "sub" / "c.txt").write_text(text(3))
    (src / ".hidden.txt").write_text("never read")
    (src / "notes.md").write_text("not a type read here")
    (tmp_path / "z.txt").write_text(text(4))
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    m = prepare([str(tmp_path / "z.txt"), str(src), "./src/a.txt"], tokenizer, str(out),
                workers=1)
    # the file first, then the folder sorted; a.txt named twice (two ways) is read once
    assert decoded(out, tokenizer) == [text(4), text(1), text(2), text(3)]
    assert m["documents"] == 4 and m["files"] == 4 and m["eod_id"] == 0
    assert m["dtype"] == "uint16" and m["vocab_size"] == 300 and m["format"] == "mscale-tokens"
    # what every id stands for, beside the file's bytes: a blend compares sources by it
    assert m["vocab_sha256"] == vocab_sha256(load_tokenizer(tokenizer))
    assert m["tokens"] == sum(len(d) for d in docs_of(out))
    assert json.loads((out / "manifest.json").read_text()) == m
    assert verify_dataset(str(out)) == []
    assert sorted(os.listdir(tmp_path)) == ["out", "src", "z.txt"]  # no temporary folder left


def test_jsonl_lines_compressed_and_a_custom_field(tokenizer, tmp_path):
    rows = [{"body": text(i), "id": i} for i in range(5)]
    plain = write_jsonl(tmp_path / "a.jsonl", rows[:2] + ["", {"body": ""}, {"body": None}])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[2:4]))
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(json.dumps(rows[4]).encode() + b"\n"))
    out = tmp_path / "out"
    m = prepare([str(plain), str(tmp_path / "b.jsonl.gz"), str(tmp_path / "c.jsonl.zst")],
                tokenizer, str(out), text_field="body", workers=1)
    assert decoded(out, tokenizer) == [r["body"] for r in rows]
    assert m["empty_documents_skipped"] == 2  # "" and null; the blank line is no document


def test_parquet_rows_by_column(tokenizer, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": [text(i) for i in range(6)], "n": list(range(6))}), path)
    out = tmp_path / "out"
    prepare([str(path)], tokenizer, str(out), column="content", workers=1)
    assert decoded(out, tokenizer) == [text(i) for i in range(6)]
    with pytest.raises(MscaleError, match="no column 'text'") as e:
        prepare([str(path)], tokenizer, str(tmp_path / "o2"), workers=1)
    assert e.value.file == str(path) and e.value.field == "text" and "--column" in e.value.fix
    with pytest.raises(MscaleError, match="not a string column"):
        prepare([str(path)], tokenizer, str(tmp_path / "o2"), column="n", workers=1)
    (tmp_path / "cut.parquet").write_bytes(path.read_bytes()[:100])
    with pytest.raises(MscaleError, match="not a readable parquet file") as e:
        prepare([str(tmp_path / "cut.parquet")], tokenizer, str(tmp_path / "o2"), workers=1)
    assert e.value.file == str(tmp_path / "cut.parquet")


def test_parquet_without_pyarrow_says_install_it(tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(MscaleError, match="needs pyarrow") as e:
        prepare([str(path)], tokenizer, str(tmp_path / "out"), workers=1)
    assert "install pyarrow" in e.value.fix and not (tmp_path / "out").exists()
    assert "--skip-bad" not in e.value.fix  # it would not help: never skipped


def test_output_is_byte_identical_for_one_and_two_workers(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_DOCS", 3)  # many batches, spread over both workers
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": text(i)} for i in range(40)])
    runs = {}
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        runs[w] = prepare([str(corpus)], tokenizer, str(out), workers=w, shard_tokens=400)
    assert runs[1] == runs[2] and len(runs[1]["shards"]) > 1
    for name in sorted(os.listdir(tmp_path / "w1")):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert decoded(tmp_path / "w2", tokenizer) == [text(i) for i in range(40)]


def test_shards_roll_at_shard_tokens_without_splitting_documents(tokenizer, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": text(i)} for i in range(30)]
                         + [{"text": text(99, 400) * 3}])  # one long document at the end
    whole = prepare([str(corpus)], tokenizer, str(tmp_path / "whole"), workers=1)
    assert len(whole["shards"]) == 1
    m = prepare([str(corpus)], tokenizer, str(tmp_path / "rolled"), workers=1, shard_tokens=200)
    shards = m["shards"]
    assert [s["prefix"] for s in shards] == [f"shard-{i:05d}" for i in range(len(shards))]
    assert all(s["tokens"] <= 200 for s in shards[:-1])
    assert shards[-1]["documents"] == 1 and shards[-1]["tokens"] > 200  # alone in its shard
    assert sum(s["documents"] for s in shards) == 31
    a, b = open_dataset(str(tmp_path / "whole")), open_dataset(str(tmp_path / "rolled"))
    assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    assert np.array_equal(a.document_starts(), b.document_starts())


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["</s>"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w65536")
    m = prepare([str(tmp_path / "a.txt")], str(tmp_path / "big.json"), str(tmp_path / "out"),
                workers=1)
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_001 and m["eod_id"] == 70_000
    assert docs_of(tmp_path / "out")[0].tolist() == [1, 69999, 65536, 70000]


def test_eod_given_explicitly(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("the model")
    m = prepare([str(tmp_path / "a.txt")], tokenizer, str(tmp_path / "out"), eod="5",
                workers=1)
    assert m["eod_id"] == 5 and docs_of(tmp_path / "out")[0][-1] == 5


def test_fsspec_urls_and_globs(tokenizer, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/x/a.txt", text(1).encode())
    fs.pipe("/corpus/x/b.jsonl", (json.dumps({"text": text(2)}) + "\n").encode())
    (tmp_path / "g1.txt").write_text(text(3))
    (tmp_path / "g2.txt").write_text(text(4))
    out = tmp_path / "out"
    prepare(["memory://corpus/x", str(tmp_path / "g*.txt")], tokenizer, str(out), workers=1)
    assert decoded(out, tokenizer) == [text(1), text(2), text(3), text(4)]


def test_progress_reports_documents_tokens_and_bytes(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BATCH_DOCS", 4)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": text(i)} for i in range(10)])
    seen, started = [], []
    m = prepare([str(corpus)], tokenizer, str(tmp_path / "out"), workers=1,
                progress=lambda *a: seen.append(a), on_start=started.append)
    assert started[0]["files"] == 1 and started[0]["bytes"] == corpus.stat().st_size
    assert started[0]["workers"] == 1 and started[0]["eod_token"] == "<|endoftext|>"
    assert [d for d, _, _, _ in seen] == [4, 8, 10]
    assert seen[-1] == (10, m["tokens"], corpus.stat().st_size, 0)




def test_the_cli_progress_line_is_plain_every_2_s_off_a_terminal():
    import io

    from mscale.cli.data import ProgressLine

    now = [100.0]
    stream = io.StringIO()
    line = ProgressLine("prepare", stream=stream, clock=lambda: now[0])
    line.total_bytes = 4_000_000
    line(10, 1000, 1_000_000)  # too soon: nothing
    now[0] += 2.0
    line(20, 500_000, 2_000_000)
    now[0] += 1.0
    line(30, 600_000, 3_000_000)  # within 2 s of the last line: nothing
    line.close()
    assert stream.getvalue() == ("prepare: 20 documents, 500,000 tokens, 2.0 MB of 4.0 MB (50%), "
                                 "250,000 tokens/s, 2 s\n")
