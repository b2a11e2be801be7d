"""recover/checkpoints.py: the newest committed checkpoint that verifies and precedes the bad
step, with every newer one passed over and why."""

from __future__ import annotations

import os

import pytest

from mscale.ckpt import catalog
from mscale.errors import MscaleError
from mscale.recover.checkpoints import choose_checkpoint
from mscale.recover.decision import Diagnosis
from mscale.runs.rundir import RunDir
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.fixture(scope="module")
def tensors():
    return global_state(plan(), optimizer=False)


@pytest.fixture
def run(tmp_path, tensors):
    r = RunDir(str(tmp_path / "run"))
    r.create()
    for s in (2, 4, 6):
        write_synthetic(f"{r.ckpt}/{catalog.step_dir(s)}", plan(), tensors, step=s)
    return r


def diag(bad_step=None, cls="software", symptom="crash"):
    return Diagnosis(cls=cls, symptom=symptom, summary="test", bad_step=bad_step)


def shard(run, step):
    return f"{run.ckpt}/{catalog.step_dir(step)}/rank-00000.bin"


def test_a_crash_resumes_from_latest(run):
    os.makedirs(f"{run.ckpt}/step-000008")  # a save the crash interrupted
    c = choose_checkpoint(run, diag())
    assert c.path == f"{run.ckpt}/step-000006" and c.step == 6 and c.is_latest
    assert c.rejected == [{"name": "step-000008",
                           "why": "uncommitted: its write never finished (no COMMITTED marker)"}]
    assert c.reason.startswith("step 6: the latest checkpoint")


def test_rollback_needs_a_step_strictly_before_the_bad_one(run):
    c = choose_checkpoint(run, diag(bad_step=6, cls="numerics", symptom="divergence"))
    assert c.step == 4 and not c.is_latest
    assert c.rejected == [{"name": "step-000006", "why": "holds the state after step 6, not "
                                                         "before the first bad step 6"}]
    assert choose_checkpoint(run, diag(bad_step=7)).step == 6


def test_corrupted_latest_is_passed_over_with_the_verify_problem(run):
    with open(shard(run, 6), "r+b") as f:
        f.truncate(100)
    c = choose_checkpoint(run, diag())
    assert c.step == 4 and not c.is_latest
    [r] = c.rejected
    assert r["name"] == "step-000006" and r["why"].startswith("failed quick verify: rank-00000.bin")
    assert "truncated" in r["why"]


def test_a_flipped_byte_needs_full_verify(run):
    size = os.path.getsize(shard(run, 6))
    with open(shard(run, 6), "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert choose_checkpoint(run, diag()).step == 6  # quick: sizes only
    c = choose_checkpoint(run, diag(), verify="full")
    assert c.step == 4 and c.rejected[0]["why"].startswith("failed full verify")


def test_nothing_usable(run):
    c = choose_checkpoint(run, diag(bad_step=1))
    assert c.path is None and c.step is None and not c.is_latest
    assert [r["name"] for r in c.rejected] == ["step-000006", "step-000004", "step-000002"]
    assert c.reason == "none of the 3 checkpoint(s) is usable before step 1"
    empty = RunDir(run.path("none"))
    assert choose_checkpoint(empty, diag()).path is None


def test_abandoned_directories_are_out_of_the_timeline(run):
    os.rename(f"{run.ckpt}/step-000006", f"{run.ckpt}/abandoned-step-000006-1")
    catalog.write_latest(run.ckpt, "step-000004")
    c = choose_checkpoint(run, diag())
    assert c.step == 4 and c.is_latest and c.rejected == []


def test_a_broken_latest_pointer_is_reported(run):
    """`--resume auto` would fail (or start fresh) on these: the relaunch must name the path."""
    catalog.write_latest(run.ckpt, "step-000099")
    c = choose_checkpoint(run, diag())
    assert c.step == 6 and not c.is_latest
    assert c.rejected == [{"name": "latest", "why": "names step-000099, which does not exist"}]
    with open(f"{run.ckpt}/latest", "w") as f:
        f.write("../../etc/passwd")
    c = choose_checkpoint(run, diag())
    assert c.step == 6 and not c.is_latest
    assert c.rejected[0]["why"].startswith("unreadable pointer")
    os.remove(f"{run.ckpt}/latest")  # no pointer: --resume auto loads the newest committed
    c = choose_checkpoint(run, diag())
    assert c.step == 6 and c.is_latest and not c.rollback


def test_a_crash_between_a_commit_and_its_pointer_loses_nothing(run):
    """``latest`` still names step 4 while step 6 is committed: --resume auto loads step 6
    (ckpt/resume.py), so the relaunch needs no --resume, and nothing is rolled back or pinned.
    A user trial's SIGKILL in that window had recover say "rolled back to step 6" and pin it."""
    catalog.write_latest(run.ckpt, "step-000004")
    c = choose_checkpoint(run, diag())
    assert c.step == 6 and c.is_latest and not c.rollback and c.rejected == []
    assert c.reason.startswith("step 6: the latest checkpoint")


def test_a_rollback_passes_over_a_newer_committed_checkpoint(run):
    c = choose_checkpoint(run, diag(bad_step=5, cls="numerics", symptom="divergence"))
    assert c.step == 4 and c.rollback and not c.is_latest
    catalog.write_latest(run.ckpt, "step-000099")  # a broken pointer alone: no rollback
    c = choose_checkpoint(run, diag())
    assert c.step == 6 and not c.rollback and not c.is_latest


def test_unknown_verify_mode(run):
    with pytest.raises(MscaleError, match="unknown verify mode"):
        choose_checkpoint(run, diag(), verify="fast")
