"""Pins and the retention that honours them: what a rollback needs is never deleted."""

from __future__ import annotations

import pytest

from mscale.ckpt import catalog, pins
from mscale.ckpt.commit import retain
from mscale.ckpt.resume import choose_resume
from mscale.config.records import Event
from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


@pytest.fixture(scope="module")
def tensors():
    return global_state(plan(), optimizer=False)


@pytest.fixture
def run(tmp_path):
    r = RunDir(str(tmp_path / "run"))
    r.create()
    return r


def _save(run, steps, tensors):
    for s in steps:
        write_synthetic(f"{run.ckpt}/{catalog.step_dir(s)}", plan(), tensors, step=s)


def _names(run):
    return [e.name for e in catalog.entries(run.ckpt, sizes=False)]


def _event(run, kind, step=None, **evidence):
    run.append_record(run.events, Event(source="watch" if kind != "start" else "train",
                                        kind=kind, step=step, evidence=evidence))


def test_pin_unpin_and_refuse_uncommitted(run, tensors):
    _save(run, [2], tensors)
    ck = f"{run.ckpt}/step-000002"
    assert not pins.is_pinned(ck) and pins.read_pin(ck) is None
    pins.pin(ck, "rollback target", "recover", now=5.0)
    assert pins.is_pinned(ck) and pins.read_pin(ck) == pins.Pin("rollback target", "recover", 5.0)
    assert pins.pinned(run.ckpt) == ["step-000002"]
    assert pins.unpin(ck) and not pins.unpin(ck) and not pins.is_pinned(ck)
    catalog.fs_and_path(run.ckpt)[0].makedirs(f"{run.ckpt}/step-000009")
    with pytest.raises(MscaleError, match="not a committed checkpoint"):
        pins.pin(f"{run.ckpt}/step-000009", "x", "me")


def test_a_pin_of_latest_lands_on_the_step_it_names(run, tensors):
    """`mscale ckpt pin RUN/ckpt/latest` was refused as "not a committed checkpoint"."""
    _save(run, [2, 4], tensors)
    catalog.advance_latest(run.ckpt, "step-000004")
    latest = f"{run.ckpt}/latest"
    assert pins.target(latest) == f"{run.ckpt}/step-000004"
    pins.pin(pins.target(latest), "before the LR change", "me")
    assert pins.pinned(run.ckpt) == ["step-000004"]
    assert pins.target(f"{run.ckpt}/step-000002") == f"{run.ckpt}/step-000002"


def test_unparsable_keep_still_pins(run, tensors):
    _save(run, [1, 2, 3, 4], tensors)
    with open(f"{run.ckpt}/step-000001/KEEP", "w") as f:
        f.write("keep this one please")
    assert pins.read_pin(f"{run.ckpt}/step-000001").who == "unknown"
    assert retain(run.ckpt, keep=2, newest="step-000004") == ["step-000002"]
    assert _names(run) == ["step-000001", "step-000003", "step-000004"]


def test_retention_keeps_pinned_outside_the_window(run, tensors):
    _save(run, [1, 2, 3, 4, 5], tensors)
    pins.pin(f"{run.ckpt}/step-000002", "rollback target", "recover")
    # the pinned one does not count against keep: the newest two still stay
    assert sorted(retain(run.ckpt, keep=2, newest="step-000005")) == ["step-000001",
                                                                      "step-000003"]
    assert _names(run) == ["step-000002", "step-000004", "step-000005"]


def test_open_episode_guards_the_checkpoint_before_it(run, tensors):
    _save(run, [2, 4, 6, 8], tensors)
    _event(run, "start")
    _event(run, "divergence", step=7, first_step=5, first_bad_step=5)
    assert pins.protected(run.ckpt) == {
        "step-000004": "newest checkpoint before the open divergence episode at step 5"}
    assert retain(run.ckpt, keep=2, newest="step-000008") == ["step-000002"]
    run.append_record(run.events, Event(source="recover", kind="recover", severity="critical"))
    assert "step-000004" in pins.protected(run.ckpt)  # recover refused: nothing pinned yet
    _event(run, "recover")  # recover answered it (and pinned what it chose)
    assert pins.protected(run.ckpt) == {}
    assert retain(run.ckpt, keep=2, newest="step-000008") == ["step-000004"]


def test_episode_of_an_earlier_attempt_is_closed(run, tensors):
    _save(run, [2, 4], tensors)
    _event(run, "start")
    _event(run, "nan", step=3)
    assert "step-000002" in pins.protected(run.ckpt)
    _event(run, "start")
    assert pins.protected(run.ckpt) == {}


def test_unreadable_events_delete_nothing(run, tensors):
    _save(run, [1, 2, 3], tensors)
    with open(run.events, "w") as f:
        f.write("not json\n{}\n")
    assert retain(run.ckpt, keep=1, newest="step-000003") == []
    assert _names(run) == ["step-000001", "step-000002", "step-000003"]


def test_recovers_choice_survives_the_relaunchs_saves(run, tensors):
    """Divergence from step 5; recover resumes from step 4 and pins it; the relaunch saves
    6, 8, 10, 12 with keep=2: step 4 is still there to roll back to again."""
    _save(run, [2, 4, 6], tensors)
    _event(run, "start")
    _event(run, "divergence", step=6, first_bad_step=5)
    pins.pin(f"{run.ckpt}/step-000004", "recover: before the divergence at step 5", "recover")
    _event(run, "recover")
    choose_resume(run.ckpt, f"{run.ckpt}/step-000004")  # moves step 6 aside
    _event(run, "start")
    for s in (6, 8, 10, 12):
        _save(run, [s], tensors)
        retain(run.ckpt, keep=2, newest=catalog.step_dir(s))
    assert _names(run) == ["step-000004", "step-000010", "step-000012"]


def test_watch_pins_the_divergence_rollback_target(run, tensors):
    from mscale.runs.atomic import read_jsonl
    from mscale.watch.actions import Actor
    from mscale.watch.findings import Finding

    _save(run, [10, 20, 30], tensors)
    div = Finding(kind="divergence", severity="critical", message="loss diverged",
                  first_step=25, last_step=29)
    Actor(run, clock=lambda: 7.0).handle([div], job_alive=True)
    assert pins.read_pin(f"{run.ckpt}/step-000020").who == "watch"
    assert pins.pinned(run.ckpt) == ["step-000020"]
    [ev] = [e for e in read_jsonl(run.events) if e["kind"] == "divergence"]
    assert ev["evidence"]["pinned"] is True


def test_a_pin_has_a_reason_and_a_blank_one_still_shows(run, tensors):
    """`ckpt pin --reason ''` pinned the checkpoint, and `ls` showed its pinned column empty:
    a checkpoint retention keeps, with nothing to say so."""
    _save(run, [2], tensors)
    ck = f"{run.ckpt}/step-000002"
    for blank in ("", "  "):
        with pytest.raises(MscaleError) as e:
            pins.pin(ck, blank, "me")
        assert e.value.field == "--reason" and not pins.is_pinned(ck)
    with open(f"{ck}/KEEP", "w") as f:  # one written by hand, or by an older mscale
        f.write('{"reason": "", "who": "me", "time": 1.0}')
    assert pins.read_pin(ck) == pins.Pin("(no reason given)", "me", 1.0)
