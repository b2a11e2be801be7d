"""mscale.data.prepare on bad input: one MscaleError naming the file (and line, field), nothing
left behind, an existing output kept unless --force replaces a token folder, a failure midway
leaving the old output whole; --skip-bad skipping each unreadable record and listing it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mscale.data import prepare as prep
from mscale.data.prepare import prepare
from mscale.errors import MscaleError

from tests.unit.data.corpus_text import decoded, docs_of, text, write_jsonl


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


@pytest.mark.parametrize("name, source", [("meg/c.bin", "meg/c"), ("meg/c.idx", "meg/c"),
                                          ("meg/c", "meg/c"), ("meg", "meg"),
                                          ("meg/*", "'meg/*'"), ("flat.bin", "flat.bin")])
def test_token_files_are_named_token_data_with_how_to_train_on_them(tokenizer, tmp_path,
                                                                    monkeypatch, name, source):
    """A Megatron .bin given to prepare said "unknown file type" and suggested --text-ext, which
    reads the ids' bytes as text; a prefix, as training names one, said "input not found"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meg").mkdir()
    for f in ("meg/c.bin", "meg/c.idx", "flat.bin"):
        (tmp_path / f).write_bytes(b"\x01\x00" * 8)
    e = bad(tokenizer, tmp_path, [name], "token data .* not text")
    assert e.file == name and e.field == "INPUT" and "--text-ext" not in e.fix
    assert f"training.data.path: {source.strip(chr(39))};" in e.fix
    assert f"`mscale data inspect {source}`" in e.fix
