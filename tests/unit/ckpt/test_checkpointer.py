"""Rank 0's commit re-checks the run lock: a job whose lock another job took over while it was
stopped (SIGSTOP, a hung mount, a suspended VM) commits nothing into the run it lost."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Callable

import pytest

from mscale.ckpt import catalog
from mscale.ckpt.checkpointer import Checkpointer
from mscale.ckpt.committer import Committer
from mscale.ckpt.manifest import COMMITTED, MANIFEST
from mscale.runs.lock import RunLock, ownership_lost
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.fixture(scope="module")
def tensors():
    return global_state(plan(), optimizer=False)


def _run(tmp_path, proto: str) -> str:
    return str(tmp_path / "run") if proto == "file" else f"memory://commit-{uuid.uuid4().hex}/run"


def _written(root: str, tensors) -> object:
    """step-000002 committed and ``latest``; step-000004's shards written, not yet committed
    (as when rank 0's writer thread is about to commit): its manifest, to commit."""
    p = plan()
    for step in (2, 4):
        write_synthetic(catalog.join(root, catalog.step_dir(step)), p, tensors, step=step)
    ckpt = catalog.join(root, "step-000004")
    manifest = catalog.load_committed(ckpt)
    fs, path = catalog.fs_and_path(ckpt)
    fs.rm(f"{path}/{COMMITTED}")
    fs.rm(f"{path}/{MANIFEST}")
    catalog.write_latest(root, "step-000002")
    return manifest


def _committer(root: str, lock_lost) -> tuple[Committer, list[dict]]:
    events: list[dict] = []
    return Committer(root, 3, lambda **kw: events.append(kw), lock_lost), events


def _commit_step_4(ck: Committer, manifest) -> None:
    fl = SimpleNamespace(name="step-000004", step=4, reason="interval", started=0.0)
    ck.commit(fl, manifest, {"reason": "interval"})


def _job(run: str) -> tuple[RunLock, Callable[[], str | None]]:
    """This job's lock (no heartbeat: it is the one stopped past its lease) and its check."""
    mine = RunLock(run, "job-a", settle_s=0).acquire()
    token = mine.record.token
    return mine, lambda: ownership_lost(run, "job-a", token)


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_a_lock_taken_over_before_the_commit_leaves_the_checkpoint_uncommitted(tmp_path, tensors,
                                                                              proto):
    run = _run(tmp_path, proto)
    root = catalog.join(run, "ckpt")
    manifest = _written(root, tensors)
    _, lock_lost = _job(run)
    later = time.time() + 3600  # job-a's heartbeat is an hour old: past its lease, taken over
    RunLock(run, "job-b", settle_s=0, clock=lambda: later).acquire()
    ck, events = _committer(root, lock_lost)
    _commit_step_4(ck, manifest)
    assert catalog.read_latest(root) == "step-000002"
    assert [(e.name, e.committed) for e in catalog.entries(root)] == [
        ("step-000002", True), ("step-000004", False)]  # left to job-b, not removed by job-a
    [event] = events
    assert (event["kind"], event["severity"], event["step"]) == ("checkpoint_failed", "critical", 4)
    assert event["message"].startswith("run lock taken over by run job-b (pid ")
    assert " UTC: checkpoint step 4 not committed; this job stops (exit 3)" in event["message"]
    assert event["evidence"]["latest"] == "step-000002"
    assert ck.fatal == ck.refused == ck.unsaved_end(4) and ck.fatal in event["message"]


def test_a_removed_lock_refuses_the_commit_too(tmp_path, tensors):
    run = _run(tmp_path, "file")
    root = catalog.join(run, "ckpt")
    manifest = _written(root, tensors)
    mine, lock_lost = _job(run)
    mine.fs.rm_file(mine.path)
    ck, events = _committer(root, lock_lost)
    _commit_step_4(ck, manifest)
    assert catalog.read_latest(root) == "step-000002"
    assert events[0]["message"].startswith(f"run lock lost: {run}/lock.json was removed: "
                                           "checkpoint step 4 not committed")


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_a_lock_still_held_commits(tmp_path, tensors, proto):
    run = _run(tmp_path, proto)
    root = catalog.join(run, "ckpt")
    manifest = _written(root, tensors)
    _, lock_lost = _job(run)
    ck, events = _committer(root, lock_lost)
    _commit_step_4(ck, manifest)
    assert catalog.read_latest(root) == "step-000004"
    assert [e["kind"] for e in events] == ["checkpoint"] and ck.fatal is None
    assert ck.unsaved_end(4) is None
    assert catalog.load_committed(catalog.join(root, "step-000004")).step == 4


def test_an_unreadable_lock_commits_and_says_so(tmp_path, tensors):
    """A transient read error (an NFS stale handle, a 503) is no takeover: refusing on it lost a
    whole good save. The checkpoint is committed and a warning says the check could not run."""
    run = _run(tmp_path, "file")
    root = catalog.join(run, "ckpt")
    manifest = _written(root, tensors)

    def unreadable():
        raise OSError(116, "Stale file handle")
    ck, events = _committer(root, unreadable)
    _commit_step_4(ck, manifest)
    assert catalog.read_latest(root) == "step-000004" and ck.fatal is None
    assert [(e["kind"], e["severity"]) for e in events] == [("checkpoint", "info"),
                                                            ("info", "warning")]
    assert "lock.json could not be read" in events[1]["message"]
    assert "Stale file handle" in events[1]["message"]


def test_a_manifest_no_loader_would_read_is_not_committed(tmp_path, tensors, monkeypatch):
    """Past the loaders' limit a committed checkpoint would be refused at every resume: the
    commit fails instead, and latest stays on the previous one."""
    import mscale.ckpt.commit as commit

    run = _run(tmp_path, "file")
    root = catalog.join(run, "ckpt")
    manifest = _written(root, tensors)
    monkeypatch.setattr(commit, "MAX_MANIFEST_BYTES", 1000)
    _, lock_lost = _job(run)
    ck, events = _committer(root, lock_lost)
    _commit_step_4(ck, manifest)
    assert catalog.read_latest(root) == "step-000002"
    assert events[0]["kind"] == "checkpoint_failed" and "over the 1,000" in events[0]["message"]


def test_resume_runs_the_callers_check_on_the_chosen_manifest(tmp_path, tensors):
    """Under srun/torchrun the plan-against-checkpoint checks are made here, after the
    rendezvous (train/launch.py `_launched`): rank 0 runs them on the checkpoint it chose (its
    path says whether it is the run's own, which a change of data needs), and their refusal
    reaches every rank as exit 3 before anything is loaded."""
    from mscale.errors import EXIT_BAD_INPUT, MscaleError

    root = catalog.join(_run(tmp_path, "file"), "ckpt")
    _written(root, tensors)
    ck = Checkpointer.__new__(Checkpointer)  # only what choosing reads: no process group
    ck.root, ck.opts, ck.rank, ck.group = root, SimpleNamespace(resume="auto"), 0, None
    seen = []

    def refuse(point):
        seen.append((point.manifest.step, catalog.basename(point.path)))
        raise MscaleError("holds 6 blocks", field="model.layers")
    with pytest.raises(MscaleError, match="holds 6 blocks") as e:
        ck.resume(check=refuse)
    assert seen == [(2, "step-000002")]
    assert e.value.code == EXIT_BAD_INPUT and e.value.field == "model.layers"


def test_an_error_assembling_the_manifest_is_a_failed_save_not_a_silent_one(tmp_path, tensors,
                                                                          monkeypatch):
    """The writer thread decodes the reports and builds the manifest; an error there was kept
    unread in its future (no event, no commit, training on). It is a failed save now."""
    import mscale.ckpt.commit as commit

    root = catalog.join(_run(tmp_path, "file"), "ckpt")
    _written(root, tensors)
    ck, events = _committer(root, lambda: None)

    def broken(raw):
        raise ValueError("a report that does not decode")
    monkeypatch.setattr(commit, "decode_gathered", broken)
    fl = SimpleNamespace(name="step-000004", step=4, reason="interval", started=0.0)
    ck.assemble(fl, [b"{}"], build=lambda reports: pytest.fail("built from no reports"))
    assert catalog.read_latest(root) == "step-000002"
    assert [e["kind"] for e in events] == ["checkpoint_failed"]
    assert "a report that does not decode" in events[0]["message"]
    assert ck.unsaved_end(4) is not None
