"""`verify` and the CLI on synthetic checkpoints: a good one passes; each fault is named."""

from __future__ import annotations

import json
import os

import pytest

from mscale.ckpt import catalog, files
from mscale.ckpt.commit import write_commit
from mscale.ckpt.manifest import COMMITTED, MANIFEST
from mscale.ckpt.writer import write_index
from mscale.ckpt.verify import verify
from mscale.errors import MscaleError
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("run") / "ckpt"
    p = plan(tp=2, dp=2, zero=1)
    write_synthetic(str(root / "step-000005"), p, global_state(p))
    return root / "step-000005"


@pytest.fixture
def ckpt(good, tmp_path):
    import shutil

    dst = tmp_path / "ckpt" / "step-000005"
    shutil.copytree(good, dst)
    shutil.copy(good.parent / "latest", dst.parent / "latest")
    return dst


def _problems(path, quick=False):
    rep = verify(str(path), quick=quick)
    return [(p.file, p.message) for p in rep.problems]


def test_good_checkpoint_verifies_and_latest_resolves(ckpt, cli):
    assert _problems(ckpt) == [] and _problems(ckpt, quick=True) == []
    code, out, _ = cli("ckpt", "verify", str(ckpt.parent / "latest"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["step"] == 5 and doc["shards"] == 4
    assert doc["layout"]["tp"] == 2


def test_a_latest_naming_a_missing_step_is_the_pointers_fault(ckpt, cli):
    """verify RUN reported the missing step-000099 as a checkpoint "never completed"."""
    (ckpt.parent / "latest").write_text("step-000099\n")
    for where in (ckpt.parent, ckpt.parent / "latest"):
        code, _, err = cli("ckpt", "verify", str(where))
        assert code == 2 and "latest: names step-000099, which does not exist" in err, err
        assert "never completed" not in err


def test_flipped_byte_names_the_shard(ckpt, cli):
    path = ckpt / "rank-00002.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert _problems(ckpt, quick=True) == []  # sizes only: a flip needs the full check
    bad = _problems(ckpt)
    assert bad and {f for f, _ in bad} == {"rank-00002.bin"}
    assert any("checksum mismatch" in m for _, m in bad)
    code, out, err = cli("ckpt", "verify", str(ckpt))
    assert code == 2 and "rank-00002.bin" in out and "Traceback" not in out + err


def test_missing_and_truncated_shards(ckpt):
    os.remove(ckpt / "rank-00001.bin")
    path = ckpt / "rank-00003.bin"
    path.write_bytes(path.read_bytes()[:-5])
    got = dict(_problems(ckpt, quick=True))
    assert got["rank-00001.bin"] == "missing"
    assert "truncated" in got["rank-00003.bin"]


def test_uncommitted_and_altered_manifests(ckpt):
    os.remove(ckpt / COMMITTED)
    assert ("COMMITTED", ) == tuple(f for f, _ in _problems(ckpt))
    with pytest.raises(MscaleError) as e:
        catalog.load_committed(str(ckpt))
    assert e.value.code == 2


def test_manifest_changed_after_commit(ckpt):
    doc = json.loads((ckpt / MANIFEST).read_text())
    doc["step"] = 5
    doc["time"] = 0.0
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    assert any("changed after the commit" in m for _, m in _problems(ckpt))


def _rewrite(ckpt, edit):
    """Edit the manifest and the shards' slice tables, and re-commit them, as a buggy writer
    would have."""
    m = catalog.load_manifest(str(ckpt))
    tables = [files.shard_slices(str(ckpt), m, shard) for shard in m.shards]
    edit(m, tables)
    for shard, slices in zip(m.shards, tables):
        shard.index = write_index(str(ckpt), shard.rank, shard.path, slices)
    write_commit(str(ckpt), m)


def test_paths_may_not_leave_the_directory(ckpt, tmp_path):
    original = (ckpt / MANIFEST).read_text()
    doc = json.loads(original)
    doc["shards"][0]["path"] = "../evil.bin"
    (ckpt / MANIFEST).write_text(json.dumps(doc))
    (bad,) = _problems(ckpt)[:1]
    assert bad[0] == MANIFEST and "plain file name" in bad[1]
    (ckpt / MANIFEST).write_text(original)
    outside = tmp_path / "outside.bin"
    outside.write_bytes((ckpt / "rank-00000.bin").read_bytes())
    os.remove(ckpt / "rank-00000.bin")
    os.symlink(outside, ckpt / "rank-00000.bin")
    got = _problems(ckpt)
    assert got[0][0] == "rank-00000.bin" and "outside the checkpoint" in got[0][1]


def test_coverage_gaps_and_overlaps_are_found(ckpt):
    def drop(m, tables):
        tables[1].pop()
        m.shards[1].bytes = sum(s.stored_bytes for s in tables[1])

    _rewrite(ckpt, drop)
    assert any("missing" in msg for _, msg in _problems(ckpt))

    def dup(m, tables):
        tables[0].append(tables[0][0].model_copy(update={"offset": m.shards[0].bytes}))
        m.shards[0].bytes += tables[0][0].stored_bytes

    _rewrite(ckpt, dup)
    assert any("overlaps" in msg for _, msg in _problems(ckpt))


def test_cli_pin_shows_in_ls_and_unpin_releases_it(ckpt, cli, tmp_path):
    run = str(ckpt.parent.parent)
    code, out, err = cli("ckpt", "pin", str(ckpt), "--reason", "known good before the spike")
    assert code == 0 and "pinned" in out, err
    code, out, _ = cli("ckpt", "ls", run, "--json")
    (row,) = json.loads(out)["checkpoints"]
    assert row["pin"]["reason"] == "known good before the spike" and row["pin"]["who"] == "user"
    code, out, _ = cli("ckpt", "ls", run)
    assert "known good before the spike" in out
    assert cli("ckpt", "unpin", str(ckpt))[0] == 0
    assert json.loads(cli("ckpt", "ls", run, "--json")[1])["checkpoints"][0]["pin"] is None
    assert cli("ckpt", "unpin", str(ckpt))[0] == 1  # nothing to release
    (ckpt.parent / "step-000009").mkdir()
    code, _, err = cli("ckpt", "pin", str(ckpt.parent / "step-000009"), "--reason", "x")
    assert code == 3 and "COMMITTED" in err and "Traceback" not in err
    code, _, err = cli("ckpt", "unpin", str(tmp_path / "nowhere"))
    assert code == 3 and "manifest.json" in err and "ckpt ls" in err
    (ckpt / "KEEP").mkdir()  # damaged: still a pin, said so, and the listing goes on
    code, out, _ = cli("ckpt", "ls", run, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["checkpoints"][0]["pin"]["reason"] == "KEEP present but unreadable"
    assert any("KEEP" in w for w in doc["warnings"])


def test_cli_ls_and_bad_input(ckpt, cli, tmp_path):
    (ckpt.parent / "step-000009").mkdir()
    code, out, _ = cli("ckpt", "ls", str(ckpt.parent.parent), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["latest"] == "step-000005"
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(5, "committed"),
                                                                       (9, "partial")]
    code, _, err = cli("ckpt", "verify", str(tmp_path / "nothing"))
    assert code == 3 and "fix:" in err and "Traceback" not in err
    code, _, err = cli("ckpt", "ls", str(tmp_path / "nothing"))
    assert code == 3
    code, _, err = cli("ckpt", "convert", str(ckpt), str(tmp_path / "x"))
    assert code == 3 and "--plan" in err


def test_a_directory_named_for_another_step_fails(ckpt, cli):
    """A step-5 checkpoint copied to step-000008 verified OK, and `--resume auto` took it for
    the newest by its name: a resume rolled the run back to step 5, abandoning newer ones."""
    moved = ckpt.parent / "step-000008"
    ckpt.rename(moved)
    rep = verify(str(moved), quick=True)
    assert [(p.file, p.field) for p in rep.problems] == [(MANIFEST, "step")]
    assert "step-000005" in rep.problems[0].message
    code, out, _ = cli("ckpt", "verify", str(moved))
    assert code == 2 and "FAILED" in out
    other = ckpt.parent.parent / "kept-aside"  # any other name says nothing about the step
    moved.rename(other)
    assert _problems(other) == []
