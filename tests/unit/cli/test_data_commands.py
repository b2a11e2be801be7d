"""`mscale data` in-process: `tokenizer --skip-bad` as `prepare --skip-bad` (exit 1, the skipped
records named, --json too), the first bad record's one-line exit 3 naming --skip-bad without it,
and a chained URL refused in one line. The real binary: tests/e2e/test_data_cli.py."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def dirty(tmp_path):
    """Two good documents, three unreadable .jsonl lines and a .txt that is not UTF-8."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text('{"text": "the slowest rank waits"}\n'
                                              '{"text": "cut\n{"body": "x"}\n{"text": 5}\n'
                                              '{"text": "a checkpoint lands"}\n')
    (tmp_path / "src" / "b.txt").write_bytes("café".encode("latin-1"))
    return tmp_path / "src"


def test_tokenizer_skip_bad_names_what_it_skipped_and_exits_1(cli, dirty, tmp_path):
    out = tmp_path / "t.json"
    code, stdout, err = cli("data", "tokenizer", str(dirty), "--vocab", "280", "-o", str(out),
                            "--skip-bad")
    assert code == 1 and out.exists(), stdout + err
    a = dirty / "a.jsonl"
    assert f"skipped {a}:2: not JSON" in err and f"skipped {dirty / 'b.txt'}: not UTF-8" in err
    assert "trained on 2 documents" in stdout
    last = stdout.splitlines()[-1]
    assert last == (f"WARNING 4 unreadable record(s) or file(s) skipped (--skip-bad), first "
                    f"{a}:2, {a}:3, {a}:4, ...; --json lists them")


def test_tokenizer_skip_bad_with_json_is_one_document_and_exits_1(cli, dirty, tmp_path):
    code, stdout, _ = cli("data", "tokenizer", str(dirty), "--vocab", "280", "-o",
                          str(tmp_path / "t.json"), "--skip-bad", "--json")
    doc = json.loads(stdout)
    assert code == 1 and doc["skipped_count"] == 4 and doc["documents"] == 2
    assert doc["skipped"][3] == {"where": str(dirty / "b.txt"),
                                 "why": "not UTF-8: byte offset 3 (0xe9)"}


def test_without_skip_bad_the_first_bad_record_is_one_line_exit_3(cli, dirty, tmp_path):
    out = tmp_path / "t.json"
    code, stdout, err = cli("data", "tokenizer", str(dirty), "--vocab", "280", "-o", str(out))
    assert code == 3 and stdout == "" and not out.exists()
    # the start line, then the error in one line and its fix (a progress line may come between
    # on a loaded machine: the reading thread reports every 2 s)
    start, error, fix = [x for x in err.splitlines() if " documents, " not in x]
    assert start.startswith("tokenizer: 2 file(s)")
    assert error.startswith(f"error: {dirty / 'a.jsonl'}:2: not JSON")
    assert fix.startswith("  fix: ") and "--skip-bad" in fix


def test_prepare_names_the_first_skipped_in_its_closing_line(cli, dirty, tmp_path):
    tok = tmp_path / "t.json"
    assert cli("data", "tokenizer", str(dirty), "--vocab", "280", "-o", str(tok),
               "--skip-bad")[0] == 1
    code, stdout, _ = cli("data", "prepare", str(dirty / "b.txt"), str(dirty / "a.jsonl"),
                          "--tokenizer", str(tok), "--out", str(tmp_path / "out"),
                          "--workers", "1", "--skip-bad")
    assert code == 1
    assert stdout.splitlines()[-1] == (
        f"WARNING 4 unreadable record(s) or file(s) skipped (--skip-bad), first "
        f"{dirty / 'b.txt'}, {dirty / 'a.jsonl'}:2, {dirty / 'a.jsonl'}:3, ...; listed in "
        f"{tmp_path / 'out'}/manifest.json under \"skipped\"")


@pytest.mark.parametrize("args", [
    ("tokenizer", "dir::file://{src}", "--vocab", "280", "-o", "{tmp}/o"),  # an input
    ("prepare", "{src}", "--tokenizer", "{tmp}/none.json", "--out", "simplecache::file://{tmp}/o"),
])
def test_a_chained_url_is_refused_in_one_line(cli, dirty, tmp_path, args):
    code, _, err = cli("data", *(a.format(src=dirty, tmp=tmp_path) for a in args))
    assert code == 3 and "Traceback" not in err
    error, fix = err.splitlines()
    assert error.endswith("::file://" + str(dirty if "tokenizer" in args else tmp_path / "o")
                          + ": chained fsspec URLs ('::') are not supported; fsspec reads "
                          "'::' anywhere in a URL as a chain, an IPv6 address's included")
    assert "without PROTOCOL:: in front" in fix and not (tmp_path / "o").exists()


def test_inspect_checks_every_index_of_a_prepared_folder(cli, tmp_path):
    """Training opens a prepared folder from its manifest without reading its indexes; inspect,
    one process, still checks each one (docs/data.md): a truncated .idx is exit 3, named."""
    from tests.unit.data.folders import DOCS, write_manifest

    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    idx = tmp_path / "ds" / "shard-00001.idx"
    idx.write_bytes(idx.read_bytes()[:34])  # the header alone
    code, stdout, err = cli("data", "inspect", str(tmp_path / "ds"))
    assert code == 3 and str(idx) in err and "idx.sequence_count" in err, stdout + err


def test_inspect_warns_of_uint32_ids_read_at_the_uint16_default_as_training_refuses(cli,
                                                                                   tmp_path):
    """A nanoGPT-style file of uint32 ids read at the uint16 default: inspect showed twice the
    tokens with no word, while train refuses it (blend.check_vocab). The same rule now gives a
    WARNING line and exit 1; a dtype said either way is read as said, without it."""
    import numpy as np

    from mscale.data.blend import build_splits
    from mscale.config.training import DataConfig
    from mscale.errors import MscaleError

    flat = tmp_path / "flat32.bin"
    ((np.arange(5000, dtype=np.uint32) * 7) % 1000 + 1).tofile(flat)
    with pytest.raises(MscaleError) as refused:
        build_splits(DataConfig(path=str(flat)), 63, 1, 1024)
    code, stdout, _ = cli("data", "inspect", str(flat))
    assert code == 1 and "10,000 tokens" in stdout, stdout
    warning = stdout.splitlines()[-1]
    assert warning.startswith(f"WARNING {flat}: read as uint16 (the default without --dtype)")
    why = "every second of its first 10,000 ids is 0: it holds uint32 ids"
    assert why in warning and why in refused.value.message
    assert "fix: --dtype uint32" in warning
    code, stdout, _ = cli("data", "inspect", str(flat), "--json")
    assert code == 1 and why in json.loads(stdout)["warnings"][0]
    for dtype, tokens in (("uint32", "5,000"), ("uint16", "10,000")):
        code, stdout, _ = cli("data", "inspect", str(flat), "--dtype", dtype)
        assert code == 0 and f"{tokens} tokens" in stdout and "WARNING" not in stdout, stdout


def test_the_progress_line_names_what_is_being_tokenized():
    """A large document is one batch: documents and tokens stand still for minutes, so the line
    says what is in flight."""
    import io

    from mscale.cli.data import ProgressLine

    now = [0.0]
    line = ProgressLine("prepare", stream=io.StringIO(), clock=lambda: now[0])
    line.total_bytes = 28_200_000
    now[0] = 2.0
    line(0, 0, 0, 28_200_000)
    assert line.stream.getvalue() == ("prepare: 0 documents, 0 tokens, 0.0 KB of 28.2 MB (0%), "
                                      "0 tokens/s, 2 s; 28.2 MB being tokenized\n")


def test_an_interrupted_prepare_says_so_leaves_nothing_and_exits_130(cli, tmp_path,
                                                                     monkeypatch):
    from mscale.data import encode

    (tmp_path / "a.txt").write_text("the slowest rank waits " * 50)
    code, _, _ = cli("data", "tokenizer", str(tmp_path / "a.txt"), "--vocab", "280", "-o",
                     str(tmp_path / "t.json"))
    assert code == 0

    def interrupted(self, texts):
        raise KeyboardInterrupt  # Ctrl-C, as the encoding thread hands it to the main thread

    monkeypatch.setattr(encode._Codec, "encode", interrupted)
    out = tmp_path / "out"
    code, _, err = cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer",
                       str(tmp_path / "t.json"), "--out", str(out), "--workers", "1")
    assert code == 130 and err.splitlines()[-1] == f"prepare: interrupted; nothing was " \
                                                    f"written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "t.json"]


def test_tokenizer_says_what_it_trains_on_before_it_starts(cli, tmp_path):
    """It printed nothing until the end (13 s on 28 MB): now a start line as prepare's."""
    (tmp_path / "a.txt").write_text("the slowest rank waits " * 50)
    out = tmp_path / "t.json"
    code, stdout, err = cli("data", "tokenizer", str(tmp_path / "a.txt"), "--vocab", "280",
                            "-o", str(out))
    assert code == 0, stdout + err
    assert err.splitlines()[0] == (f"tokenizer: 1 file(s), 1.1 KB, from {tmp_path / 'a.txt'}; "
                                   f"byte-level BPE, vocab 280 → {out}")


def test_an_interrupted_tokenizer_says_so_writes_nothing_and_exits_130(cli, tmp_path,
                                                                       monkeypatch):
    from mscale.data import tokenizer as tok_mod

    def interrupted(texts, vocab):
        raise KeyboardInterrupt  # Ctrl-C, as the training thread hands it back

    monkeypatch.setattr(tok_mod, "train_bpe", interrupted)
    (tmp_path / "a.txt").write_text("the slowest rank waits")
    out = tmp_path / "t.json"
    code, _, err = cli("data", "tokenizer", str(tmp_path / "a.txt"), "--vocab", "280", "-o",
                       str(out))
    assert code == 130 and err.splitlines()[-1] == f"tokenizer: interrupted; nothing was " \
                                                    f"written to {out}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_the_progress_line_says_the_merges_are_being_computed():
    import io

    from mscale.cli.data import ProgressLine

    now = [0.0]
    line = ProgressLine("tokenizer", stream=io.StringIO(), clock=lambda: now[0])
    now[0] = 14.0
    line(1, None, 28_200_000, note="computing merges, 13 s")
    assert line.stream.getvalue() == ("tokenizer: 1 document, 28.2 MB, 14 s; computing merges, "
                                      "13 s\n")


def test_verify_says_what_it_hashes_before_it_starts(cli, tmp_path):
    """A corpus of thousands of shards hashes for an hour: verify said nothing until its
    verdict. Now a start line on stderr (stdout stays the verdict), then progress."""
    from mscale.data.manifest import verify_checksums
    from tests.unit.data.folders import DOCS, write_manifest

    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    code, stdout, err = cli("data", "verify", str(tmp_path / "ds"))
    assert code == 0 and stdout.startswith("OK "), stdout + err
    assert err.startswith(f"verify: {tmp_path / 'ds'}: 4 file(s), ") and "manifest.json" in err
    seen = []
    verify_checksums(str(tmp_path / "ds"), progress=lambda *a: seen.append(a))
    total = seen[0][3]
    assert [a[:2] for a in seen] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert seen[-1][2:] == (total, total) and total > 0


def test_verify_s_fix_line_is_true_for_each_kind_of_source(cli, tmp_path):
    """A damaged Megatron pair (no manifest) was told "re-run mscale data prepare", which reads
    text and writes a folder of its own: it cannot rebuild the pair. Each kind now gets a fix
    that works: the pair's own tool; prepare --force for a prepared folder (it refuses an
    existing --out without it); a new folder when the manifest is unreadable (--force replaces
    only a folder whose manifest it can read)."""
    from tests.unit.data.folders import DOCS, reference_write, write_manifest

    reference_write(tmp_path / "corpus", DOCS)
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    write_manifest(tmp_path / "garbled", [DOCS])
    for damaged in (tmp_path / "corpus.bin", tmp_path / "ds" / "shard-00001.bin"):
        with open(damaged, "r+b") as f:
            f.truncate(4)
    (tmp_path / "garbled" / "manifest.json").write_text("garbage")
    fixes = {}
    for name in ("corpus", "ds", "garbled"):
        code, stdout, _ = cli("data", "verify", str(tmp_path / name))
        assert code == 2 and stdout.startswith(f"FAILED {tmp_path / name}"), stdout
        fixes[name] = stdout.splitlines()[-1]
    assert "Megatron-LM tools/preprocess_data.py" in fixes["corpus"]
    assert "--force" not in fixes["corpus"] and "--out DIR, and train on DIR" in fixes["corpus"]
    assert fixes["ds"].endswith(f"--tokenizer TOKENIZER --out {tmp_path / 'ds'} --force")
    assert "--out NEW_FOLDER" in fixes["garbled"] and "--force" not in fixes["garbled"]
    assert all(f.startswith("  fix: ") and "re-run" not in f for f in fixes.values()), fixes
