"""check_output: every kind of unwritable destination is one MscaleError naming the path."""

from __future__ import annotations

import os

import pytest

from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path
from mscale.runs.targets import check_output


def test_writable_new_paths_pass(tmp_path):
    check_output(str(tmp_path / "a" / "b" / "plan.yaml"), "file", "-o")
    check_output(str(tmp_path / "run"), "dir", "--run-dir")
    check_output("memory://bucket/run", "dir", "--run-dir")


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_under_a_regular_file(tmp_path, kind):
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(MscaleError, match="is a file, not a directory") as e:
        check_output(str(tmp_path / "README.md" / "x"), kind, "-o")
    assert e.value.file.endswith("README.md/x")


def test_wrong_kind(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(MscaleError, match="expected a directory"):
        check_output(str(tmp_path / "f"), "dir", "--run-dir")
    with pytest.raises(MscaleError, match="expected a file"):
        check_output(str(tmp_path), "file", "-o")


def test_a_directory_given_for_a_file_is_told_a_name_of_that_kind(tmp_path):
    """``--prometheus DIR`` was told "e.g. DIR/plan.yaml": a plan name for a textfile."""
    with pytest.raises(MscaleError) as e:
        check_output(str(tmp_path), "file", "-o")
    assert e.value.fix.endswith(os.path.join(str(tmp_path), "plan.yaml"))
    with pytest.raises(MscaleError) as e:
        check_output(str(tmp_path), "file", "--prometheus", example="mscale.prom")
    assert "plan.yaml" not in e.value.fix
    assert e.value.fix.endswith(os.path.join(str(tmp_path), "mscale.prom"))


def test_fifo_is_not_a_file(tmp_path):
    os.mkfifo(tmp_path / "p")
    with pytest.raises(MscaleError, match="not a regular file"):
        check_output(str(tmp_path / "p"), "file", "-o")


def test_unknown_protocol_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("foo://b/run", "nosuch://x"):
        with pytest.raises(MscaleError, match="unknown storage protocol") as e:
            check_output(url, "dir", "--run-dir")
        assert e.value.file == url
        with pytest.raises(MscaleError):
            fs_and_path(url)
    assert list(tmp_path.iterdir()) == []  # no local 'foo:' directory appeared


@pytest.mark.parametrize("kind, make", [("dir", False), ("dir", True), ("file", True)])
def test_a_read_only_filesystem_is_named_as_such_not_as_a_permission(tmp_path, monkeypatch,
                                                                     kind, make):
    """os.access refuses on a read-only mount as on a missing permission; the fixes differ."""
    target = tmp_path / "out"
    if make:
        target.mkdir() if kind == "dir" else target.write_text("x")
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
        tuple(real)[:8] + (real.f_flag | os.ST_RDONLY, real.f_namemax)))
    with pytest.raises(MscaleError) as e:
        check_output(str(target), kind, "--run-dir")
    assert "read-only filesystem" in e.value.message and "remount" in e.value.fix


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_place_where_nothing_can_be_created_is_refused_even_for_root(kind):
    """os.access says yes to root under /proc; the command then failed at its end."""
    refused = (r"-o: (/proc is on the kernel's proc filesystem|no permission to create it in "
               r"/proc|/proc is on a read-only filesystem)")  # root | another user | hardened
    with pytest.raises(MscaleError, match=refused):
        check_output("/proc/mscale-nope/out", kind, "-o")


def test_the_check_writes_nothing(tmp_path):
    """Every rank of an srun job checks the run directory at once: a probe file raced another
    rank's creation of it (CI48)."""
    from mscale.runs.targets import _fstype

    check_output(str(tmp_path / "plan.yaml"), "file", "-o")
    check_output(str(tmp_path), "dir", "--run-dir")
    assert list(tmp_path.iterdir()) == []
    assert _fstype("/proc/self") == "proc" and _fstype(str(tmp_path)) not in (None, "proc")


def test_an_os_error_escaping_a_command_names_its_file_not_an_internal_error():
    from mscale.cli.main import _internal_error

    err = _internal_error(FileNotFoundError(2, "No such file or directory", "/proc/x/p.yaml"))
    assert err.file == "/proc/x/p.yaml" and err.code == 3
    assert err.message == "No such file or directory (FileNotFoundError, errno 2)"
    moved = _internal_error(FileNotFoundError(2, "No such file or directory", "a", None, "/x/b"))
    assert moved.message.startswith("No such file or directory (to /x/b)")
    assert _internal_error(ValueError("x")).message == "internal error: ValueError: x"


def test_commands_refuse_a_memory_destination(cli, tmp_path):
    """Each process has its own memory filesystem: train said "committed", convert "wrote", and
    nothing was left (the library accepts it: tests convert in memory)."""
    from tests.conftest import PLANS

    for args in (["train", str(PLANS / "cpu-tiny.yaml"), "--local", "8", "--run-dir",
                  "memory://r10"],
                 ["ckpt", "convert", str(tmp_path), "memory://conv", "--to-hf"],
                 ["plan", "--cluster", str(PLANS / "clusters" / "cpu-4x2.yaml"), "--model",
                  str(PLANS / "models" / "tiny.yaml"), "--training",
                  str(PLANS / "training" / "cpu-demo.yaml"), "-o", "memory://p.yaml"]):
        code, _, err = cli(*args)
        assert code == 3 and "memory:// lives only inside the process" in err, (args, err)
