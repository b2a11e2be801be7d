"""`ckpt convert` checks everything it can before writing a byte (level, destination, the step a
step-NNNNNN directory names), never moves a run's `latest` backwards, and removes what it wrote
when it fails."""

from __future__ import annotations

import json
import os

import pytest

from mscale.ckpt import catalog
from mscale.ckpt.convert import convert
from mscale.config.base import dump_yaml
from mscale.errors import MscaleError
from tests.unit.ckpt.helpers import plan
from tests.unit.ckpt.hostile import copy_run, no_crash, run_with_plan


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return run_with_plan(tmp_path_factory.mktemp("good"))


@pytest.fixture
def run(good, tmp_path):
    return copy_run(good, tmp_path / "run")


def _plan(good) -> str:
    return str(good.parent / "plan.yaml")


def test_zstd_level_is_range_checked_and_has_one_name(run, good, cli, tmp_path):
    with pytest.raises(MscaleError) as e:
        convert(str(run), str(tmp_path / "a"), plan=_plan(good), level=99)
    assert e.value.field == "--zstd-level" and not (tmp_path / "a").exists()
    for flag, value in (("--zstd-level", "99"), ("--zstd-level", "23"), ("--zstd-level", "-8")):
        code, out, err = cli("ckpt", "convert", str(run), str(tmp_path / "b"), "--plan",
                             _plan(good), flag, value)
        assert code == 3 and no_crash(code, out, err) and flag in err
    assert not (tmp_path / "b").exists()
    code, out, err = cli("ckpt", "convert", str(run), str(tmp_path / "c"), "--plan", _plan(good),
                         "--level", "3")  # no second spelling in a 0.1 tool
    assert code == 3 and "--level" in err and not (tmp_path / "c").exists()
    code, out, _ = cli("ckpt", "convert", "--help")
    assert "--zstd-level" in out and "--level " not in out


def test_destinations_are_checked_before_any_work(run, cli, tmp_path, monkeypatch):
    (tmp_path / "README.md").write_text("x")
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, out, err = cli("ckpt", "convert", str(run), "README.md/x", "--to-hf")
    assert code == 3 and no_crash(code, out, err) and "DEST" in err and "README.md" in err
    for args in (("convert", str(run), "foo://x", "--to-hf"), ("ls", "foo://x"),
                 ("verify", "foo://x"), ("convert", "foo://x", "out", "--to-hf")):
        code, out, err = cli("ckpt", *args)
        assert code == 3 and no_crash(code, out, err) and "foo" in err, args
    assert sorted(os.listdir(tmp_path)) == before  # nothing created locally


def test_a_step_directory_must_hold_that_step(run, good, cli, tmp_path):
    dst = tmp_path / "other" / "ckpt" / "step-000001"
    code, out, err = cli("ckpt", "convert", str(run), str(dst), "--plan", _plan(good))
    assert code == 3 and no_crash(code, out, err) and "step-000005" in err
    assert not dst.exists() and not dst.parent.exists()


def test_latest_never_moves_backwards(run, good, cli):
    older = run.parent / "older"
    (run / "ckpt" / "step-000002").rename(older)  # the run now has only step 5, its latest
    dst = run / "ckpt" / "step-000002"
    code, out, err = cli("ckpt", "convert", str(older), str(dst), "--plan", _plan(good), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["latest"] == "step-000005" and "--resume" in doc["note"]
    assert catalog.read_latest(str(run / "ckpt")) == "step-000005"
    code, out, _ = cli("ckpt", "ls", str(run), "--json")
    assert code == 0 and json.loads(out)["latest"] == "step-000005"


def test_a_failed_conversion_removes_what_it_wrote(run, good, tmp_path):
    shard = run / "ckpt" / "step-000005" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x55
    shard.write_bytes(bytes(data))
    with pytest.raises(MscaleError, match="checksum mismatch"):
        convert(str(run), str(tmp_path / "out"), plan=_plan(good))
    assert not (tmp_path / "out").exists()


def test_a_plan_of_another_model_is_refused(run, tmp_path, cli):
    other = tmp_path / "other.yaml"
    other.write_text(dump_yaml(plan(dp=2, model={"layers": 3})))
    code, out, err = cli("ckpt", "convert", str(run), str(tmp_path / "out"), "--plan", str(other))
    assert code == 3 and no_crash(code, out, err) and "model.layers" in err and "other.yaml" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(60)  # a FIFO config.json must not block
@pytest.mark.parametrize("kind", ["utf-16", "binary", "deep", "empty", "FIFO"])
def test_hf_config_json_that_is_not_utf8_json_is_named(run, tmp_path, cli, good, kind,
                                                       monkeypatch):
    monkeypatch.setattr("mscale.config.files.PIPE_WAIT_S", 0.2)  # the FIFO: give up sooner
    hf = tmp_path / "hf"
    assert cli("ckpt", "convert", str(run), str(hf), "--to-hf")[0] == 0
    config = hf / "config.json"
    text = config.read_text()
    if kind == "FIFO":
        config.unlink()
        os.mkfifo(config)
    else:
        config.write_bytes({"utf-16": text.encode("utf-16"), "binary": b"\x89PNG\r\n\x1a\n",
                            "deep": b"[" * 100_000 + b"]" * 100_000, "empty": b""}[kind])
    code, out, err = cli("ckpt", "convert", str(hf), str(tmp_path / "out"), "--plan", _plan(good))
    assert code == 3 and no_crash(code, out, err) and "config.json" in err
    assert not (tmp_path / "out").exists()


def test_the_notes_resume_path_is_quoted_for_the_shell(good, cli, tmp_path):
    """The note's `--resume DST` is for pasting into a shell: a run directory with a space
    printed bare there is two arguments."""
    run = copy_run(good, tmp_path / "my run")
    older = tmp_path / "older"
    (run / "ckpt" / "step-000002").rename(older)
    dst = run / "ckpt" / "step-000002"
    code, out, err = cli("ckpt", "convert", str(older), str(dst), "--plan", _plan(good), "--json")
    assert code == 0 and json.loads(out)["note"].endswith(f"--resume '{dst}'")


def test_a_source_named_for_another_step_is_refused(run, cli, tmp_path):
    """A step-2 checkpoint copied to step-000009: converting the run took it for the newest by
    its name and exported step 2 as the run's weights."""
    import shutil

    shutil.copytree(run / "ckpt" / "step-000002", run / "ckpt" / "step-000009")
    for src in (run, run / "ckpt" / "step-000009"):
        code, out, err = cli("ckpt", "convert", str(src), str(tmp_path / "hf"), "--to-hf")
        assert code == 3 and no_crash(code, out, err) and "rename it step-000002" in err, err
        assert not (tmp_path / "hf").exists()
