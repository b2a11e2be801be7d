"""The run's ckpt/ directory: retention, pointers, and tidying before a resume."""

from __future__ import annotations

import pytest

from mscale.ckpt import catalog, commit
from mscale.ckpt.resume import choose_resume
from mscale.errors import MscaleError
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.fixture(scope="module")
def tensors():
    return global_state(plan(), optimizer=False)


def _make(root, steps, tensors, partial=()):
    p = plan()
    for s in steps:
        write_synthetic(f"{root}/{catalog.step_dir(s)}", p, tensors, step=s)
    for s in partial:
        catalog.fs_and_path(root)[0].makedirs(f"{root}/{catalog.step_dir(s)}", exist_ok=True)


def _names(root):
    return [(e.name, e.committed) for e in catalog.entries(root)]


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_retention_keeps_newest_and_latest(tmp_path, tensors, proto):
    root = str(tmp_path / "ckpt") if proto == "file" else f"memory://ret{id(tmp_path)}/ckpt"
    _make(root, [1, 2, 3, 4], tensors, partial=[0, 9])
    assert catalog.read_latest(root) == "step-000004"
    removed = commit.retain(root, keep=2, newest="step-000004")
    assert sorted(removed) == ["step-000000", "step-000001", "step-000002"]
    assert _names(root) == [("step-000003", True), ("step-000004", True), ("step-000009", False)]
    assert commit.retain(root, keep=0, newest="step-000004") == ["step-000003"]


def test_resolve_accepts_run_ckpt_latest_and_dir(tmp_path, tensors):
    root = tmp_path / "run" / "ckpt"
    _make(str(root), [3], tensors)
    want = str(root / "step-000003")
    for given in (tmp_path / "run", root / "latest", root / "step-000003", root,
                  root / "step-000003" / "manifest.json"):
        assert catalog.resolve(str(given)).rstrip("/") == want
    with pytest.raises(MscaleError):
        catalog.resolve(str(tmp_path / "none"))


def test_resolve_of_a_run_takes_what_resume_auto_loads(tmp_path, tensors):
    """``ckpt verify RUN`` and ``ckpt convert RUN`` followed ``latest`` as written: after a
    crash between a commit and its pointer they checked and exported an older checkpoint than
    the relaunch loads, and without a ``latest`` they said "no checkpoint here"."""
    root = tmp_path / "run" / "ckpt"
    _make(str(root), [3, 5], tensors)
    catalog.write_latest(str(root), "step-000003")
    for given in (tmp_path / "run", root):
        assert catalog.resolve(str(given)) == catalog.join(str(root), "step-000005")
    assert catalog.resolve(str(root / "latest")).endswith("step-000003")  # the pointer, as told
    (root / "latest").unlink()
    assert catalog.resolve(str(tmp_path / "run")).endswith("step-000005")
    assert choose_resume(str(root), "auto").path.endswith("step-000005")


def test_resolve_refuses_a_file_that_is_not_a_pointer_as_bad_input(tmp_path):
    """`mscale ckpt verify RUN/plan.yaml` is a wrong argument (exit 3), not a damaged `latest`
    pointer (exit 2) whose fix would be to rewrite the user's plan file."""
    from mscale.errors import EXIT_BAD_INPUT

    plan = tmp_path / "plan.yaml"
    plan.write_text("name: cpu-tiny\n")
    with pytest.raises(MscaleError) as e:
        catalog.resolve(str(plan))
    assert e.value.code == EXIT_BAD_INPUT and "is a file, not a checkpoint" in str(e.value)
    assert "rewrite" not in str(e.value.fix)
    (tmp_path / "latest").write_text("name: cpu-tiny\n")  # a real pointer, damaged: exit 2
    with pytest.raises(MscaleError) as e:
        catalog.resolve(str(tmp_path / "latest"))
    assert e.value.code != EXIT_BAD_INPUT and "rewrite" in str(e.value.fix)


def test_choose_resume_tidies(tmp_path, tensors):
    root = str(tmp_path / "ckpt")
    _make(root, [2, 4, 6], tensors, partial=[8])
    point = choose_resume(root, "auto")
    assert point.manifest.step == 6 and "removed step-000008 (never committed)" in point.cleaned
    with pytest.raises(MscaleError, match=r"already has 3 committed checkpoints \(the newest "
                       r"step-000006\)") as e:
        choose_resume(root, "none")
    assert e.value.field == "--resume"
    with pytest.raises(MscaleError, match="no such checkpoint") as e:  # a typo'd --resume path
        choose_resume(root, str(tmp_path / "bogus"))
    assert e.value.field == "--resume"
    point = choose_resume(root, f"{root}/step-000004")  # a rollback
    assert point.manifest.step == 4
    names = [n for n, _ in _names(root)]
    assert names == ["step-000002", "step-000004"]
    assert any(c.startswith("moved step-000006 to abandoned-step-000006") for c in point.cleaned)
    # latest named the step moved aside: a crash before the next commit found it naming nothing
    assert catalog.read_latest(root) == "step-000004"
    assert choose_resume(root, "auto").manifest.step == 4


def test_a_foreign_resume_path_only_starts_a_run(tmp_path, tensors):
    """--resume OTHER_RUN starts the run; the same command run again after a halt continues
    from the run's own latest (it rolled back to OTHER_RUN and moved the newer ones aside)."""
    other, root = str(tmp_path / "other" / "ckpt"), str(tmp_path / "run" / "ckpt")
    _make(other, [3], tensors)
    first = choose_resume(root, f"{other}/latest")
    assert first.manifest.step == 3 and first.path == f"{other}/step-000003"
    assert not any(c.startswith("note: ") for c in first.cleaned)
    _make(root, [5, 7], tensors)
    again = choose_resume(root, f"{other}/latest")
    assert again.manifest.step == 7 and again.path == f"{root}/step-000007"
    assert again.cleaned[0].startswith(f"note: --resume {other}/latest only starts a run")
    assert [n for n, _ in _names(root)] == ["step-000005", "step-000007"]  # nothing moved
    assert choose_resume(root, f"{root}/step-000005").manifest.step == 5  # an own rollback


def test_an_own_rollback_spelled_otherwise_is_still_a_rollback(tmp_path, tensors):
    """Through a symlinked directory or '..' it read as foreign, and the run continued from its
    latest, through the bad step again (review, helper-47)."""
    import os

    root = tmp_path / "run" / "ckpt"
    _make(str(root), [2, 4, 6], tensors)
    os.symlink(tmp_path / "run", tmp_path / "alias")
    point = choose_resume(str(root), str(tmp_path / "alias" / "ckpt" / "step-000004"))
    assert point.manifest.step == 4 and not any(c.startswith("note: ") for c in point.cleaned)
    (tmp_path / "x").mkdir()
    point = choose_resume(str(root), str(tmp_path / "x" / ".." / "run" / "ckpt" / "step-000002"))
    assert point.manifest.step == 2


def test_a_foreign_path_never_moves_the_runs_own_checkpoints_aside(tmp_path, tensors):
    """Committed checkpoints but no latest (a crash between the first commit and its pointer):
    the newest of them, not the foreign one (review, helper-47)."""
    import os

    other, root = tmp_path / "other" / "ckpt", tmp_path / "run" / "ckpt"
    _make(str(other), [3], tensors)
    _make(str(root), [5, 7], tensors)
    os.remove(root / "latest")
    point = choose_resume(str(root), f"{other}/latest")
    assert point.manifest.step == 7 and [n for n, _ in _names(str(root))] == [
        "step-000005", "step-000007"]
    # latest lagging behind a committed checkpoint: what auto loads, not the pointer's older one,
    # which moved step 7 aside while recover called the relaunch lossless (review, helper-79)
    catalog.write_latest(str(root), "step-000005")
    point = choose_resume(str(root), f"{other}/latest")
    assert point.manifest.step == 7 and [n for n, _ in _names(str(root))] == [
        "step-000005", "step-000007"]


def test_auto_without_latest_continues_from_the_newest_committed(tmp_path, tensors):
    """A crash between a first commit and its pointer (or a latest deleted by hand): --resume auto
    trained from step 0 and moved every committed checkpoint aside as abandoned."""
    import os

    from mscale.ckpt.resume import check_resume

    root = tmp_path / "run" / "ckpt"
    _make(str(root), [2, 4], tensors, partial=[6])
    os.remove(root / "latest")
    assert check_resume(str(root), "auto").step == 4
    point = choose_resume(str(root), "auto")
    assert point.manifest.step == 4 and point.path == f"{root}/step-000004"
    assert point.cleaned[0].startswith(f"note: {root}/latest is missing (a crash between a "
                                       "commit and its pointer); continuing from the newest "
                                       "committed checkpoint, step-000004")
    assert _names(str(root)) == [("step-000002", True), ("step-000004", True)]


def test_fresh_run_has_no_resume_point(tmp_path):
    assert choose_resume(str(tmp_path / "ckpt"), "auto") is None
    assert choose_resume(str(tmp_path / "ckpt"), "none") is None


def test_a_huggingface_folder_is_told_to_be_converted_first(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MscaleError) as e:
        catalog.resolve(str(tmp_path))
    assert "HuggingFace model folder" in str(e.value)
    assert e.value.fix.startswith(f"convert it first: mscale ckpt convert {tmp_path} DST --plan")


def test_a_committed_checkpoint_without_its_manifest_is_named_as_damaged_everywhere(tmp_path,
                                                                                   tensors):
    """manifest.json deleted after the commit: ls, verify and the loaders used to give three
    stories (committed; never completed; altered after its commit). Now one: removed after the
    commit, exit 2, under any name of the directory (helper-42's trial)."""
    from mscale.ckpt.verify import verify

    _make(str(tmp_path), [3], tensors)
    ckpt = tmp_path / "mine"
    (tmp_path / "step-000003").rename(ckpt)
    (ckpt / "manifest.json").unlink()
    assert catalog.resolve(str(ckpt)) == str(ckpt)
    with pytest.raises(MscaleError, match="removed after the commit") as e:
        catalog.load_committed(str(ckpt))
    assert e.value.code == 2
    (problem,) = verify(str(ckpt)).problems
    assert "removed after the commit" in problem.message


def test_a_latest_made_as_a_symbolic_link_is_named_with_its_fix(tmp_path, tensors):
    """`ln -s step-000002 latest` read as a checkpoint altered after its commit (exit 2)."""
    import os

    root = tmp_path / "ckpt"
    _make(str(root), [2], tensors)
    os.remove(root / "latest")
    os.symlink("step-000002", root / "latest")
    with pytest.raises(MscaleError, match=r"is a symbolic link \(to step-000002\)") as e:
        catalog.read_latest(str(root))
    assert e.value.code == 3 and f"echo step-000002 > {root}/latest" in e.value.fix


def test_a_retention_error_leaves_the_new_checkpoint_committed_and_named(tmp_path, tensors,
                                                                        monkeypatch):
    """Retention runs after `latest` names the new checkpoint: its error (an NFS rmtree meeting
    a reader's .nfs file) was raised as the commit's, and the caller then removed the very
    checkpoint `latest` named: the next resume found none."""
    root = str(tmp_path / "ckpt")
    _make(root, [2, 4], tensors)
    manifest = catalog.load_committed(f"{root}/step-000004")

    def boom(*args, **kwargs):
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(commit, "retain", boom)
    out = commit.commit(root, "step-000004", manifest, keep=1)
    assert out["removed"] == [] and "Directory not empty" in out["retention_error"]
    assert catalog.read_latest(root) == "step-000004"
    assert _names(root) == [("step-000002", True), ("step-000004", True)]


def test_a_commit_error_after_latest_moved_keeps_the_checkpoint(tmp_path, tensors, monkeypatch):
    """An error raised once `latest` names the checkpoint (a failed fsync after the rename) must
    not remove it: it is committed and named, and said so with a warning."""
    from types import SimpleNamespace

    from mscale.ckpt.committer import Committer

    root = str(tmp_path / "ckpt")
    _make(root, [2, 4], tensors)

    def fails_late(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(commit, "commit", fails_late)
    events = []
    ck = Committer(root, 3, lambda **kw: events.append(kw))
    fl = SimpleNamespace(name="step-000004", step=4, reason="interval", started=0.0)
    ck.commit(fl, catalog.load_committed(f"{root}/step-000004"), {})
    assert [e["kind"] for e in events] == ["checkpoint", "info"] and not ck.failed
    assert "an error came after latest was moved to it" in events[1]["message"]
    assert _names(root) == [("step-000002", True), ("step-000004", True)]


def test_auto_prefers_a_committed_checkpoint_newer_than_latest(tmp_path, tensors):
    """A crash between step 6's COMMITTED and its pointer: latest still names step 4. Resuming
    it lost an interval and moved the complete step 6 aside as abandoned."""
    from mscale.ckpt.resume import check_resume

    root = tmp_path / "run" / "ckpt"
    _make(str(root), [2, 4, 6], tensors)
    (root / "latest").write_text("step-000004")
    assert check_resume(str(root), "auto").step == 6
    point = choose_resume(str(root), "auto")
    assert point.manifest.step == 6
    assert point.cleaned[0].startswith(f"note: {root}/latest names step-000004, an older one")
    assert _names(str(root)) == [("step-000002", True), ("step-000004", True),
                                 ("step-000006", True)]


def test_removing_a_checkpoint_uncommits_it_first(tmp_path, tensors, monkeypatch):
    """A delete that stops half way (a crash, an NFS .nfs file) must leave an uncommitted attempt,
    not a committed checkpoint missing shards."""
    import fsspec.implementations.local as local

    root = str(tmp_path / "ckpt")
    _make(root, [2, 4], tensors)
    real = local.LocalFileSystem.rm

    def rm(self, path, recursive=False, **kw):
        if recursive:
            raise OSError(39, "Directory not empty")
        return real(self, path, recursive=recursive, **kw)

    monkeypatch.setattr(local.LocalFileSystem, "rm", rm)
    with pytest.raises(OSError):
        catalog.remove(f"{root}/step-000002")
    assert _names(root) == [("step-000002", False), ("step-000004", True)]


def test_a_checkpoint_named_for_another_step_is_refused_at_resume(tmp_path, tensors):
    """A step-2 checkpoint copied to step-000008: --resume auto took it for the newest by its
    name, moved the real step-000006 aside and rolled the run back to step 2."""
    import shutil

    from mscale.ckpt.resume import check_resume

    root = tmp_path / "run" / "ckpt"
    _make(str(root), [2, 6], tensors)
    shutil.copytree(root / "step-000002", root / "step-000008")
    for resume in (check_resume, choose_resume):
        with pytest.raises(MscaleError) as e:
            resume(str(root), "auto")
        assert e.value.file == f"{root}/step-000008" and "step-000002" in e.value.fix
    assert _names(str(root)) == [("step-000002", True), ("step-000006", True),
                                 ("step-000008", True)]  # nothing moved aside
