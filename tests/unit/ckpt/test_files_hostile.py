"""Checkpoint files of the wrong kind (a directory, a FIFO), garbage `latest` pointers, and the
error texts readers give: each a clean error naming the file, never a hang or a traceback."""

from __future__ import annotations

import errno
import json
import os

import pytest

from mscale.ckpt import catalog
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import MANIFEST
from mscale.ckpt.resume import check_resume, choose_resume
from mscale.ckpt.verify import verify
from mscale.errors import MscaleError
from tests.unit.ckpt.hostile import copy_run, make_run, no_crash


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("good") / "run", steps=(2, 5), dp=2)


@pytest.fixture
def run(good, tmp_path):
    return copy_run(good, tmp_path / "run")


def _replace(path, kind: str) -> None:
    path.unlink()
    path.mkdir() if kind == "directory" else os.mkfifo(path)


@pytest.mark.timeout(60)  # a FIFO used to block verify forever in open()
@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_shard_that_is_not_a_regular_file(run, kind, cli):
    ckpt = run / "ckpt" / "step-000005"
    _replace(ckpt / "rank-00001.bin", kind)
    (problem,) = verify(str(ckpt)).problems
    assert problem.file == "rank-00001.bin" and f"is a {kind}" in problem.message
    code, out, err = cli("ckpt", "verify", str(ckpt), "--quick")
    assert code == 2 and no_crash(code, out, err) and "rank-00001.bin" in out
    m = catalog.load_committed(str(ckpt))
    with CheckpointReader(str(ckpt), m) as reader, pytest.raises(MscaleError) as e:
        for key in m.tensors:
            reader.read_full(key)
    assert e.value.file.endswith("rank-00001.bin") and f"is a {kind}" in e.value.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_manifest_that_is_not_a_regular_file(run, kind, cli):
    ckpt = run / "ckpt" / "step-000005"
    _replace(ckpt / MANIFEST, kind)
    problem = verify(str(ckpt)).problems[0]
    assert problem.file == MANIFEST and f"is a {kind}" in problem.message
    for args, want in ((("verify", str(ckpt)), 2), (("ls", str(run)), 1),
                       (("convert", str(ckpt), str(run / "hf"), "--to-hf"), 2)):
        code, out, err = cli("ckpt", *args)
        assert code == want and no_crash(code, out, err) and MANIFEST in out + err, args
    with pytest.raises(MscaleError, match=f"is a {kind}"):
        choose_resume(str(run / "ckpt"), "auto")


BAD_LATEST = {
    "outside": (b"../../etc\n", "names '../../etc'"),
    "binary": (b"\x00\xff\x01\x02", "NUL byte"),
    "latin-1": (b"step-00000\xe9", "not UTF-8"),
    "utf-16": ("step-000005".encode("utf-16"), "UTF-16"),
    "a shard": (b"rank-00000.bin", "not a checkpoint directory"),
    "missing step": (b"step-000009", "names step-000009, which does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_LATEST))
def test_bad_latest_is_named_by_ls_verify_and_resume(run, case, cli):
    data, fragment = BAD_LATEST[case]
    latest = run / "ckpt" / "latest"
    latest.write_bytes(data)
    for check in (choose_resume, check_resume):
        with pytest.raises(MscaleError) as e:
            check(str(run / "ckpt"), "auto")
        assert e.value.file == str(latest) and fragment in e.value.message
        assert "shard" not in e.value.message
    code, out, err = cli("ckpt", "ls", str(run), "--json")
    doc = json.loads(out)
    assert code == 1 and no_crash(code, out, err) and "latest" in doc["warnings"][0]
    assert [c["step"] for c in doc["checkpoints"]] == [2, 5]
    if case != "missing step":
        assert doc["latest"] is None
        code, out, err = cli("ckpt", "verify", str(latest))
        assert code in (2, 3) and no_crash(code, out, err) and str(latest) in err


def test_damaged_chunk_names_the_shard_once(run):
    ckpt = run / "ckpt" / "step-000005"
    shard = ckpt / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    m = catalog.load_committed(str(ckpt))
    with CheckpointReader(str(ckpt), m) as reader, pytest.raises(MscaleError) as e:
        for key in m.tensors:
            reader.read_full(key)
    text = str(e.value)
    assert text.count("rank-00001.bin") == 1 and "chunk 0: checksum mismatch" in text, text


def test_symlink_outside_names_the_shard_once(run, tmp_path):
    ckpt = run / "ckpt" / "step-000005"
    outside = tmp_path / "elsewhere.bin"
    (ckpt / "rank-00000.bin").rename(outside)
    os.symlink(outside, ckpt / "rank-00000.bin")
    m = catalog.load_committed(str(ckpt))
    with CheckpointReader(str(ckpt), m) as reader, pytest.raises(MscaleError) as e:
        for key in m.tensors:
            reader.read_full(key)
    assert str(e.value).count("rank-00000.bin") == 1 and "outside" in e.value.message


def test_entries_and_ls_say_when_name_and_manifest_disagree(run, cli):
    (run / "ckpt" / "step-000005").rename(run / "ckpt" / "step-000001")
    code, out, err = cli("ckpt", "ls", str(run), "--json")
    doc = json.loads(out)
    row = next(c for c in doc["checkpoints"] if c["name"] == "step-000001")
    assert code == 1 and row["step"] == 1 and row["manifest_step"] == 5
    assert "step 5" in row["note"] and any("step-000001" in w for w in doc["warnings"])


def test_fsync_failure_fails_the_shard_write(run, monkeypatch):
    """A shard whose fsync fails (EIO) must fail its save, not be committed as durable."""
    from mscale.ckpt.ownership import for_plan, write_items
    from mscale.ckpt.snapshot import Snapshot
    from mscale.ckpt.writer import write_shard
    from tests.unit.ckpt.helpers import plan

    items = write_items(for_plan(plan(), 0))[:2]
    import torch

    views = [torch.zeros(it.count).view(torch.uint8) for it in items]
    snap = Snapshot(items, views, 0.0, sum(v.numel() for v in views))

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError, match="Input/output error"):
        write_shard(str(run / "ckpt" / "step-000009"), 0, snap, "raw", 0, 1024)


def test_check_resume_loads_without_tidying(run):
    (run / "ckpt" / "step-000009").mkdir()  # a dead attempt: choose_resume would remove it
    assert check_resume(str(run / "ckpt"), "auto").step == 5
    assert check_resume(str(run / "ckpt"), str(run / "ckpt" / "step-000002")).step == 2
    assert (run / "ckpt" / "step-000009").is_dir() and (run / "ckpt" / "step-000005").is_dir()
    with pytest.raises(MscaleError, match="already has 2 committed checkpoints"):
        check_resume(str(run / "ckpt"), "none")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_latest_that_is_not_a_regular_file(run, kind, cli):
    latest = run / "ckpt" / "latest"
    _replace(latest, kind)
    for args, want in ((("verify", str(run)), 2), (("ls", str(run)), 1)):
        code, out, err = cli("ckpt", *args)
        assert code == want and no_crash(code, out, err) and f"is a {kind}" in out + err, args
    with pytest.raises(MscaleError, match=f"is a {kind}") as e:
        check_resume(str(run / "ckpt"), "auto")
    assert e.value.file == str(latest)
