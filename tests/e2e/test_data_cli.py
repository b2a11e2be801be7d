"""`mscale data` through the real binary: prepare, inspect, verify (and a damaged shard found),
and a bad input reported in one line with exit 3, no traceback. `mscale data tokenizer` and the
rest of docs/data.md's example run in tests/e2e/test_docs.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mscale.data.tokenizer import train_tokenizer
from tests.e2e.train_run import mscale

pytestmark = pytest.mark.e2e

WORDS = ("a pipeline stage waits while the slowest rank finishes its step and the checkpoint "
         "writer drains every shard to storage").split()


def corpus(root: Path) -> Path:
    rng = random.Random(0)
    root.mkdir()
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))})
             for _ in range(200)]
    (root / "part-0.jsonl").write_text("\n".join(lines[:120]) + "\n")
    (root / "part-1.jsonl").write_text("\n".join(lines[120:]) + "\n")
    (root / "readme.txt").write_text("one document per .txt file\n")
    return root


def test_tokenizer_prepare_inspect_verify(tmp_path):
    src = corpus(tmp_path / "src")
    tok = tmp_path / "tokenizer.json"  # `mscale data tokenizer` runs in docs/data.md's test
    train_tokenizer([str(src)], 320, str(tok))
    out = tmp_path / "tokens"
    p = mscale("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out),
               "--workers", "2", "--shard-tokens", "1000")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 worker(s)" in p.stderr and "tokens/s" in p.stdout and "201 documents" in p.stdout

    p = mscale("data", "inspect", str(out), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    m = json.loads((out / "manifest.json").read_text())
    assert d["kind"] == "mscale shards" and d["documents"] == 201 == m["documents"]
    assert d["tokens"] == m["tokens"] and d["vocab_size"] == 320 and d["eod_id"] == 0
    assert len(d["shards"]) == len(m["shards"]) > 1

    p = mscale("data", "verify", str(out))
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stdout + p.stderr

    bin1 = out / "shard-00001.bin"
    data = bytearray(bin1.read_bytes())
    data[10] ^= 0xFF  # same size: only the checksum can tell
    bin1.write_bytes(bytes(data))
    p = mscale("data", "verify", str(out))
    assert p.returncode == 2 and "shard-00001.bin" in p.stdout and "FAILED" in p.stdout, p.stdout

    (out / "shard-00000.idx").unlink()  # a missing file is a failed check too, not bad input
    p = mscale("data", "verify", str(out), "--json")
    d = json.loads(p.stdout)
    assert p.returncode == 2 and not d["ok"] and d["tokens"] is None, p.stdout + p.stderr
    assert any("shard-00000.idx: missing" in x for x in d["problems"]), d


def test_bad_input_is_one_line_and_exit_3(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (tmp_path / "t.json").write_text("{")
    p = mscale("data", "prepare", str(tmp_path / "a.jsonl"),
               "--tokenizer", str(tmp_path / "t.json"), "--out", str(tmp_path / "out"))
    assert p.returncode == 3 and "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert lines[0].startswith(f"error: {tmp_path / 't.json'}: --tokenizer: not a valid"), p.stderr
    assert len(lines) == 2 and lines[1].startswith("  fix: ")
    assert not (tmp_path / "out").exists()


def test_skip_bad_goes_on_past_a_bad_record_and_exits_1(tmp_path):
    src = corpus(tmp_path / "src")
    (src / "part-2.jsonl").write_text('{"text": "kept"}\n{"body": "no text field"}\n')
    tok = tmp_path / "tokenizer.json"
    train_tokenizer([str(src / "part-0.jsonl")], 300, str(tok))
    out = tmp_path / "tokens"
    p = mscale("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out))
    assert p.returncode == 3 and f"error: {src / 'part-2.jsonl'}:2: text: no field" in p.stderr
    assert "or pass --skip-bad" in p.stderr.splitlines()[-1]  # the fix line names the option
    p = mscale("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out),
               "--skip-bad")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"skipped {src / 'part-2.jsonl'}:2: no field 'text'" in p.stderr
    assert (f"WARNING 1 unreadable record(s) or file(s) skipped (--skip-bad), first "
            f"{src / 'part-2.jsonl'}:2; listed in") in p.stdout
    assert "202 documents" in p.stdout  # 201 of the clean corpus, and "kept"
    assert json.loads((out / "manifest.json").read_text())["skipped_count"] == 1
    p = mscale("data", "prepare", str(src), "--tokenizer", str(tok), "--out", str(out),
               "--skip-bad", "--force", "--json")
    assert p.returncode == 1 and json.loads(p.stdout)["skipped_count"] == 1, p.stdout + p.stderr
