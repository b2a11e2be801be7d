"""mscale.data.prepare: text in input order → shards with EOD after every document, the same
bytes for any worker count, one clean error per bad input, nothing half-written on a failure."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from mscale.data import prepare as prep
from mscale.data.datasets import open_dataset, verify_dataset
from mscale.data.prepare import prepare
from mscale.data.tokenizer import load_tokenizer, train_tokenizer
from mscale.errors import MscaleError

WORDS = ("the model trains on tokens while every rank waits for the slowest link and a "
         "checkpoint lands before the node fails again data parallel pipeline tensor").split()


def text(seed: int, n: int = 40) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n))) + "."


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> str:
    """A 300-id byte-level BPE trained on a few KB (<|endoftext|> = 0)."""
    d = tmp_path_factory.mktemp("tokenizer")
    (d / "corpus.txt").write_text("\n".join(text(i, 80) for i in range(60)))
    out = d / "tokenizer.json"
    train_tokenizer([str(d / "corpus.txt")], 300, str(out))
    return str(out)


def docs_of(out: Path) -> list[np.ndarray]:
    ds = open_dataset(str(out))
    tokens = ds.read(0, ds.num_tokens)
    return [tokens[a:b] for a, b in zip(ds.document_starts()[:-1], ds.document_starts()[1:])]


def decoded(out: Path, tokenizer: str) -> list[str]:
    tok = load_tokenizer(tokenizer)
    docs = docs_of(out)
    assert all(d[-1] == 0 for d in docs)  # every document ends with EOD
    return [tok.decode(d[:-1].tolist()) for d in docs]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


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


# --- bad input: one MscaleError naming the file (and line, field), nothing left behind ------

def bad(tokenizer: str, tmp_path: Path, inputs: list[str], match: str, **kw) -> MscaleError:
    with pytest.raises(MscaleError, match=match) as e:
        prepare(inputs, tokenizer, str(tmp_path / "out"), workers=1, **kw)
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    assert e.value.fix
    return e.value


def test_empty_corpus(tokenizer, tmp_path):
    (tmp_path / "e.txt").write_text("")
    write_jsonl(tmp_path / "e.jsonl", ["", {"text": ""}])
    e = bad(tokenizer, tmp_path, [str(tmp_path / "e.txt"), str(tmp_path / "e.jsonl")],
            "empty corpus")
    assert "2 empty" in e.message


def test_not_utf8_names_file_and_byte_offset(tokenizer, tmp_path):
    (tmp_path / "l.txt").write_bytes("café".encode("latin-1"))
    e = bad(tokenizer, tmp_path, [str(tmp_path / "l.txt")], "not UTF-8: byte offset 3")
    assert e.file == str(tmp_path / "l.txt")
    (tmp_path / "l.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    e = bad(tokenizer, tmp_path, [str(tmp_path / "l.jsonl")], "line 2, byte offset 28")
    assert e.file == str(tmp_path / "l.jsonl")


@pytest.mark.parametrize("line, match, field", [
    ('{"text": "a"', "not JSON", None),
    ('["a"]', "not an object", None),
    ('{"body": "a"}', "no field 'text'", "text"),
    ('{"text": 3}', "is a int, not a string", "text"),
    ('{"text": "\\ud800"}', "surrogate", "text"),
])
def test_bad_jsonl_lines_name_file_and_line(tokenizer, tmp_path, line, match, field):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, line])
    e = bad(tokenizer, tmp_path, [str(path)], match)
    assert e.file == f"{path}:2" and e.field == field


def test_missing_input_and_unknown_extension(tokenizer, tmp_path):
    e = bad(tokenizer, tmp_path, [str(tmp_path / "nope.txt")], "input not found")
    assert e.file == str(tmp_path / "nope.txt")
    (tmp_path / "a.csv").write_text("x")
    e = bad(tokenizer, tmp_path, [str(tmp_path / "a.csv")], "unknown file type")
    assert "--text-ext" in e.fix
    (tmp_path / "d.parquet.gz").write_bytes(b"x")
    bad(tokenizer, tmp_path, [str(tmp_path / "d.parquet.gz")], "compressed .parquet")
    (tmp_path / "empty").mkdir()
    bad(tokenizer, tmp_path, [str(tmp_path / "empty")], "holds no file")
    bad(tokenizer, tmp_path, [str(tmp_path / "*.jsonl")], "no file matches")


def test_a_glob_of_files_not_read_here_says_how_many_and_names_text_ext(tokenizer, tmp_path):
    """`corpA/*.py` matching 5 files said "no readable file matches this pattern" and "check
    the pattern"; the folder and single-file forms named --text-ext."""
    corpus = tmp_path / "corpA"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"m{i}.py").write_text("print(1)")
    e = bad(tokenizer, tmp_path, [str(corpus / "*.py")], "5 file")
    assert e.message == "5 file(s) match, none of a type read here (.py)"
    assert e.file == str(corpus / "*.py") and e.field == "INPUT"
    assert "--text-ext .py" in e.fix
    m = prepare([str(corpus / "*.py")], tokenizer, str(tmp_path / "out"), workers=1,
                text_exts=[".py"])
    assert m["documents"] == 5


def test_bad_tokenizer_and_eod(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("x")
    e = bad(str(tmp_path / "none.json"), tmp_path, [str(tmp_path / "a.txt")], "not found")
    assert e.field == "--tokenizer"
    (tmp_path / "broken.json").write_text("{")
    bad(str(tmp_path / "broken.json"), tmp_path, [str(tmp_path / "a.txt")], "not a valid")
    e = bad(tokenizer, tmp_path, [str(tmp_path / "a.txt")], "no token", eod="</s>")
    assert e.field == "--eod"


def test_an_existing_out_is_refused_and_force_replaces_only_a_token_folder(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text(text(1))
    out = tmp_path / "out"
    prepare([str(tmp_path / "a.txt")], tokenizer, str(out), workers=1)
    with pytest.raises(MscaleError, match="already exists") as e:
        prepare([str(tmp_path / "a.txt")], tokenizer, str(out), workers=1)
    assert "--force" in e.value.fix
    (tmp_path / "b.txt").write_text(text(2))
    prepare([str(tmp_path / "b.txt")], tokenizer, str(out), workers=1, force=True)
    assert decoded(out, tokenizer) == [text(2)]
    other = tmp_path / "home"
    other.mkdir()
    (other / "precious").write_text("keep")
    with pytest.raises(MscaleError, match="not a token folder"):
        prepare([str(tmp_path / "a.txt")], tokenizer, str(other), workers=1, force=True)
    assert (other / "precious").read_text() == "keep"
    for url in ("memory://x/out", "s3://bucket/out"):  # s3fs need not be installed to say so
        with pytest.raises(MscaleError, match="local folder"):
            prepare([str(tmp_path / "a.txt")], tokenizer, url, workers=1)


def test_an_out_under_a_file_is_refused_before_any_work(tokenizer, tmp_path):
    """It failed at the end with a bare OSError naming DIR.tmp-<pid> ("Not a directory"), no
    field, after the start line and the workers."""
    (tmp_path / "a.txt").write_text(text(1))
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub" / "out"
    with pytest.raises(MscaleError, match="is a file, not a folder") as e:
        prepare([str(tmp_path / "a.txt")], tokenizer, str(out), workers=1)
    assert e.value.field == "--out" and e.value.file == str(out)
    assert str(tmp_path / "afile") in e.value.message


def test_a_failure_midway_leaves_no_output_and_keeps_the_old_one(tokenizer, tmp_path,
                                                                monkeypatch):
    monkeypatch.setattr(prep, "BATCH_DOCS", 2)
    good = write_jsonl(tmp_path / "a.jsonl", [{"text": text(i)} for i in range(20)])
    broken = write_jsonl(tmp_path / "b.jsonl", [{"text": "ok"}, "{oops"])
    written = []
    real = prep.IndexedWriter.close

    def close(self):
        written.append(self.prefix)
        return real(self)

    monkeypatch.setattr(prep.IndexedWriter, "close", close)
    for force in (False, True):
        with pytest.raises(MscaleError, match="not JSON"):
            prepare([str(good), str(broken)], tokenizer, str(tmp_path / "out"),
                    workers=1 if force else 2, shard_tokens=100, force=force)
        assert len(written) > 1  # shards were complete before the bad line was reached
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]
        if not force:
            assert not (tmp_path / "out").exists()
            prepare([str(good)], tokenizer, str(tmp_path / "out"), workers=1)
            before = (tmp_path / "out" / "manifest.json").read_bytes()
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before  # the old one, whole


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


def test_skip_bad_skips_each_unreadable_record_and_lists_it(tokenizer, tmp_path, monkeypatch):
    """--skip-bad: a bad .jsonl line, a non-UTF-8 .txt and a .parquet without the column are
    skipped (the rest of their files kept), each reported and listed; the shards hold exactly
    what a clean corpus of the good records gives."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq
    dirty = tmp_path / "dirty"
    dirty.mkdir()
    good = [text(i) for i in range(4)]
    write_jsonl(dirty / "a.jsonl", [{"text": good[0]}, '{"text": "cut', {"body": "x"},
                                    {"text": good[1]}])
    (dirty / "b.txt").write_bytes("café".encode("latin-1"))
    (dirty / "c.txt").write_text(good[2])
    pq.write_table(pa.table({"n": [1, 2]}), dirty / "d.parquet")
    write_jsonl(dirty / "e.jsonl", [{"text": good[3]}])
    seen = []
    m = prepare([str(dirty)], tokenizer, str(tmp_path / "out"), workers=1, on_skip=seen.append)
    where = [e.file for e in seen]
    assert where == [f"{dirty / 'a.jsonl'}:2", f"{dirty / 'a.jsonl'}:3", str(dirty / "b.txt"),
                     str(dirty / "d.parquet")]
    assert m["skipped_count"] == 4 and [s["where"] for s in m["skipped"]] == where
    assert "no column 'text'" in m["skipped"][3]["why"]
    assert decoded(tmp_path / "out", tokenizer) == good
    clean = tmp_path / "clean"
    clean.mkdir()
    write_jsonl(clean / "a.jsonl", [{"text": g} for g in good])
    prepare([str(clean / "a.jsonl")], tokenizer, str(tmp_path / "ref"), workers=1)
    assert [d.tolist() for d in docs_of(tmp_path / "out")] == \
        [d.tolist() for d in docs_of(tmp_path / "ref")]
    # without it the first bad record stops prepare, as before
    bad(tokenizer, tmp_path / "clean", [str(dirty)], "not JSON")


def test_skip_bad_never_skips_a_missing_pyarrow(tokenizer, tmp_path, monkeypatch):
    """Skipping it would silently drop every .parquet file."""
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    (tmp_path / "a.txt").write_text("fine")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    seen = []
    with pytest.raises(MscaleError, match="needs pyarrow"):
        prepare([str(tmp_path)], tokenizer, str(tmp_path / "out"), workers=1,
                on_skip=seen.append)
    assert seen == []
