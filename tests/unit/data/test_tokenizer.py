"""mscale.data.tokenizer: local tokenizer.json only, the end-of-document id, local BPE training."""

from __future__ import annotations

import json
import random

import pytest

from mscale.data.tokenizer import (SPECIAL, eod_id, load_tokenizer, read_tokenizer,
                                   tokenizer_path, train_tokenizer)
from mscale.errors import MscaleError

WORDS = ("the model trains on tokens while every rank waits for the slowest link and a "
         "checkpoint lands before the node fails again data parallel pipeline tensor").split()


def text(seed: int, n: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + ".\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    for i in range(4):
        (d / f"doc{i}.txt").write_text(text(i))
    out = d / "tokenizer.json"
    info = train_tokenizer([str(d)], 300, str(out))
    return out, info


def test_train_writes_a_byte_level_bpe_with_endoftext_first(trained):
    out, info = trained
    assert info["vocab_size"] == 300 and info["eod_id"] == 0 and info["documents"] == 4
    tok = load_tokenizer(str(out))
    assert tok.token_to_id(SPECIAL) == 0
    sample = "the slowest link fails ünïcödé 🚀 too"
    assert tok.decode(tok.encode(sample).ids) == sample  # byte-level: anything round-trips
    assert not list(out.parent.glob("*.tmp-*"))


def test_train_refuses_to_overwrite_without_force(trained, tmp_path):
    out, _ = trained
    with pytest.raises(MscaleError, match="already exists") as e:
        train_tokenizer([str(out.parent / "doc0.txt")], 300, str(out))
    assert e.value.field == "--out"
    copy = tmp_path / "t.json"
    copy.write_text("old")
    info = train_tokenizer([str(out.parent / "doc0.txt")], 280, str(copy), force=True)
    assert info["vocab_size"] == 280 and json.loads(copy.read_text())["model"]["type"] == "BPE"


def test_an_out_under_a_file_is_refused_naming_the_option(trained, tmp_path):
    """It was a bare "File exists (FileExistsError, errno 17)" naming the parent."""
    out, _ = trained
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MscaleError, match="is a file, not a folder") as e:
        train_tokenizer([str(out.parent / "doc0.txt")], 300, str(tmp_path / "afile" / "t.json"))
    assert e.value.field == "--out" and (tmp_path / "afile").read_text() == "x"


def test_train_refuses_a_vocabulary_out_of_range_and_empty_text(tmp_path):
    (tmp_path / "a.txt").write_text(text(1))
    with pytest.raises(MscaleError, match="out of range") as e:
        train_tokenizer([str(tmp_path / "a.txt")], 100, str(tmp_path / "t.json"))
    assert e.value.field == "--vocab"
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(MscaleError, match="no documents"):
        train_tokenizer([str(tmp_path / "empty.txt")], 300, str(tmp_path / "t.json"))
    assert not (tmp_path / "t.json").exists()


def test_a_folder_holding_tokenizer_json_is_read(trained):
    out, _ = trained
    assert tokenizer_path(str(out.parent)) == str(out)
    path, raw, sha = read_tokenizer(str(out.parent))
    assert path == str(out) and len(sha) == 64 and json.loads(raw)["model"]["type"] == "BPE"


@pytest.mark.parametrize("spec, match", [
    ("hf://meta-llama/Llama-3.1-8B", "never downloads"),
    ("https://example.com/tokenizer.json", "never downloads"),
    ("meta-llama/Llama-3.1-8B", "hub name"),
    ("./no/such/tokenizer.json", "not found"),
])
def test_anything_but_a_local_file_is_refused_with_the_fix(spec, match):
    with pytest.raises(MscaleError, match=match) as e:
        load_tokenizer(spec)
    assert e.value.field == "--tokenizer" and e.value.file == spec
    assert "tokenizer.json" in e.value.fix


def test_folders_without_tokenizer_json_and_broken_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MscaleError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    sp = tmp_path / "sp"
    sp.mkdir()
    (sp / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(MscaleError, match="SentencePiece") as e:
        load_tokenizer(str(sp))
    assert "save_pretrained" in e.value.fix
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 3}')
    with pytest.raises(MscaleError, match="not a valid tokenizer.json") as e:
        load_tokenizer(str(bad))
    assert e.value.file == str(bad)


def _word_level(tmp_path, vocab: dict[str, int]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "wl.json"
    tok.save(str(path))
    return load_tokenizer(str(path))


def test_eod_is_found_by_name_or_given(tmp_path):
    tok = _word_level(tmp_path, {"[UNK]": 0, "a": 1, "</s>": 2, "<eos>": 3})
    assert eod_id(tok) == 2  # </s> comes before <eos> in the list
    assert eod_id(tok, "<eos>") == 3
    assert eod_id(tok, "1") == 1  # digits: an id
    with pytest.raises(MscaleError, match="outside the vocabulary"):
        eod_id(tok, "4")
    with pytest.raises(MscaleError, match="no token '<nope>'") as e:
        eod_id(tok, "<nope>", file="wl.json")
    assert e.value.field == "--eod" and e.value.file == "wl.json"


def test_no_eod_token_is_an_error_naming_the_option(tmp_path):
    tok = _word_level(tmp_path, {"[UNK]": 0, "a": 1})
    with pytest.raises(MscaleError, match="end-of-document") as e:
        eod_id(tok)
    assert e.value.field == "--eod" and "--eod TOKEN" in e.value.fix


def _dirty(folder) -> list[str]:
    """A clean .jsonl's documents, and beside it the same with unreadable lines between them and a
    .txt that is not UTF-8; returns the documents."""
    docs = [text(i, 60) for i in range(6)]
    (folder / "clean").mkdir()
    (folder / "clean" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                      for d in docs))
    lines = [json.dumps({"text": d}) for d in docs]
    lines[2:2] = ['{"text": "cut', json.dumps({"body": "x"}), json.dumps({"text": 5})]
    (folder / "dirty").mkdir()
    (folder / "dirty" / "a.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "dirty" / "b.txt").write_bytes("café".encode("latin-1"))
    return docs


def test_skip_bad_trains_on_what_is_readable_and_lists_what_is_not(tmp_path):
    """--skip-bad as prepare's: every unreadable record and file is reported and listed, and the
    tokenizer is the one the clean corpus gives, byte for byte."""
    _dirty(tmp_path)
    dirty = tmp_path / "dirty"
    seen = []
    r = train_tokenizer([str(dirty)], 300, str(tmp_path / "d.json"), on_skip=seen.append)
    where = [f"{dirty / 'a.jsonl'}:{n}" for n in (3, 4, 5)] + [str(dirty / "b.txt")]
    assert [e.file for e in seen] == where
    assert r["skipped_count"] == 4 and [s["where"] for s in r["skipped"]] == where
    assert "not a string" in r["skipped"][2]["why"] and "not UTF-8" in r["skipped"][3]["why"]
    clean = train_tokenizer([str(tmp_path / "clean")], 300, str(tmp_path / "c.json"))
    assert r["documents"] == clean["documents"] == 6 and r["sha256"] == clean["sha256"]
    assert "skipped_count" not in clean  # without --skip-bad the report is as before


def test_without_skip_bad_the_first_bad_record_stops_and_names_the_option(tmp_path):
    _dirty(tmp_path)
    out = tmp_path / "t.json"
    with pytest.raises(MscaleError, match="not JSON") as e:
        train_tokenizer([str(tmp_path / "dirty")], 300, str(out))
    assert e.value.file == f"{tmp_path / 'dirty' / 'a.jsonl'}:3"
    assert "--skip-bad" in e.value.fix and "one JSON object" in e.value.fix
    assert not out.exists()


def test_skip_bad_with_nothing_readable_left_says_so(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(MscaleError, match=r"empty or skipped \(1 unreadable\)"):
        train_tokenizer([str(tmp_path / "b.txt")], 300, str(tmp_path / "t.json"),
                        on_skip=lambda e: None)
    assert not (tmp_path / "t.json").exists()


def test_training_reports_from_the_calling_thread_while_the_merges_run(tmp_path, monkeypatch):
    """The merges took 13 s on 28 MB with nothing on the console: training runs on a daemon
    thread and the caller's thread reports every WAIT_S, the merges' seconds once every document
    is read. (Held here until the merges have been reported, so the test never depends on
    timing.)"""
    import threading

    from mscale.data import tokenizer as tok_mod

    monkeypatch.setattr(tok_mod, "WAIT_S", 0.01)
    reported = threading.Event()
    real = tok_mod.train_bpe

    def held(texts, vocab):
        texts = list(texts)  # every document read: the merges start
        assert reported.wait(60), "the merges were never reported"
        return real(texts, vocab)

    monkeypatch.setattr(tok_mod, "train_bpe", held)
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(text(i))
    size = sum((tmp_path / f"doc{i}.txt").stat().st_size for i in range(3))
    seen, started, threads = [], [], []

    def progress(documents, nbytes, merging_s):
        seen.append((documents, nbytes, merging_s))
        threads.append(threading.current_thread())
        if merging_s is not None:
            reported.set()

    info = train_tokenizer([str(tmp_path)], 280, str(tmp_path / "t.json"), progress=progress,
                           on_start=started.append)
    assert started == [{"files": 3, "bytes": size, "bytes_known": True, "vocab_size": 280,
                        "out": str(tmp_path / "t.json")}]
    merging = [s for s in seen if s[2] is not None]
    assert merging and merging[-1][:2] == (3, size) and merging[-1][2] >= 0
    assert set(threads) == {threading.main_thread()}
    assert info["documents"] == 3 and load_tokenizer(str(tmp_path / "t.json"))


def test_an_error_in_the_training_thread_is_raised_in_the_caller(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(MscaleError, match="not JSON") as e:
        train_tokenizer([str(tmp_path / "a.jsonl")], 280, str(tmp_path / "t.json"))
    assert e.value.file == f"{tmp_path / 'a.jsonl'}:2" and not (tmp_path / "t.json").exists()
