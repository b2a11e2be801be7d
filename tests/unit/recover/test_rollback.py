"""recover/rollback.py: skip steps s+1..b after a divergence or a repeated NaN, retry a first
NaN on the same data, and append the window to data_skip.json."""

from __future__ import annotations

import pytest

from mscale.config.records import DataSkip, DataSkips
from mscale.errors import MscaleError
from mscale.recover.decision import CheckpointChoice, Diagnosis
from mscale.recover.rollback import (data_skip_for, nan_attempts, read_data_skips,
                                     record_data_skip)
from mscale.runs.rundir import RunDir


def diag(symptom="divergence", bad=25, cls="numerics", transient=False):
    return Diagnosis(cls=cls, symptom=symptom, summary="loss rose", bad_step=bad,
                     transient=transient)


def choice(step=20):
    return CheckpointChoice(path=f"/r/ckpt/step-{step:06d}", step=step, reason="x",
                            is_latest=False)


def test_divergence_skips_from_the_checkpoint_through_the_bad_step():
    skip = data_skip_for(diag(), choice(20))
    assert (skip.after_step, skip.skip_steps) == (20, 5)
    assert skip.reason == "divergence from step 25: loss rose"
    # steps 21..25 read steps 26..30's samples: the window 21..25 is never read
    assert [DataSkips(entries=[skip]).sample_step(t) for t in (20, 21, 25)] == [20, 26, 30]


def test_first_nan_is_retried_a_repeated_one_skipped():
    assert data_skip_for(diag("nan", transient=True), choice()) is None
    assert data_skip_for(diag("nan", transient=False), choice()).skip_steps == 5
    once = [{"kind": "start"}, {"kind": "nan", "step": 25}]
    twice = once + [{"kind": "start"}, {"kind": "nan", "step": 25, "source": "train"}]
    other = once + [{"kind": "start"}, {"kind": "nan", "step": 26}]
    assert nan_attempts(twice, 25) == 2 and nan_attempts(other, 25) == 1
    assert data_skip_for(diag("nan"), choice(), events=once) is None
    assert data_skip_for(diag("nan"), choice(), events=other) is None
    skip = data_skip_for(diag("nan", transient=True), choice(), events=twice)
    assert (skip.after_step, skip.skip_steps) == (20, 5)
    assert "two attempts" in skip.reason


def test_no_skip_without_a_numerics_bad_step():
    assert data_skip_for(diag(cls="gpu", symptom="crash"), choice()) is None
    assert data_skip_for(diag(bad=None), choice()) is None


def test_no_checkpoint_skips_from_step_zero():
    none = CheckpointChoice(path=None, step=None, reason="nothing", is_latest=False)
    skip = data_skip_for(diag(bad=3), none)
    assert (skip.after_step, skip.skip_steps) == (0, 3)


def test_a_checkpoint_at_or_after_the_bad_step_is_refused():
    with pytest.raises(MscaleError, match="does not precede"):
        data_skip_for(diag(bad=20), choice(20))


def test_record_appends_atomically(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.create()
    assert read_data_skips(run).entries == []
    record_data_skip(run, DataSkip(after_step=10, skip_steps=5, reason="a"))
    record_data_skip(run, DataSkip(after_step=30, skip_steps=2, reason="b"))
    skips = read_data_skips(run)
    assert [(e.after_step, e.skip_steps) for e in skips.entries] == [(10, 5), (30, 2)]
    assert skips.sample_step(31) == 38  # both windows add up
    (tmp_path / "run" / "data_skip.json").write_text("{not json")
    with pytest.raises(MscaleError, match="unreadable"):
        record_data_skip(run, DataSkip(after_step=1, skip_steps=1))


def test_a_second_recovery_of_the_same_attempt_records_its_window_once(tmp_path):
    """`recover --execute` run again on one failure (its relaunch never started) appended the
    window again, and train then skipped it twice: tokens never trained, no error. The same
    window answering a later attempt (a second rollback) is a new one and adds up."""
    run = RunDir(str(tmp_path / "run"))
    run.create()
    window = dict(after_step=10, skip_steps=5, reason="NaN at step 15 in two attempts")
    assert record_data_skip(run, DataSkip(**window, attempt=3))
    assert not record_data_skip(run, DataSkip(**window, attempt=3))
    assert record_data_skip(run, DataSkip(**window, attempt=4))
    assert [e.attempt for e in read_data_skips(run).entries] == [3, 4]
    d = diag(bad=20)
    d.attempt = 7
    assert data_skip_for(d, choice(10)).attempt == 7


def test_a_rollback_before_an_earlier_window_reaches_past_everything_the_failed_run_read(
        tmp_path):
    """Attempt 1 diverged at 250 and rolled back to 200 skipping 50 steps; attempt 2 (reading
    step t's data at t + 50) diverged at 230, and 200 was rejected: rolling back to 100, the
    window counted in steps (100, 130) re-read the diverged data (attempt 3 read from 231 up,
    where attempt 2 had diverged on 251-280) and the old window still applied on top. The new
    one starts after the last data attempt 2 read, and the old one is superseded."""
    from mscale.config.records import DataSkips

    run = RunDir(str(tmp_path / "run"))
    run.create()
    assert record_data_skip(run, DataSkip(after_step=200, skip_steps=50, attempt=1))
    d = diag(bad=230)
    d.attempt = 2
    skip = data_skip_for(d, choice(100), skips=read_data_skips(run))
    assert (skip.after_step, skip.skip_steps) == (100, 180)
    assert record_data_skip(run, skip)
    skips = read_data_skips(run)
    assert [(e.after_step, e.skip_steps) for e in skips.entries] == [(100, 180)]
    assert skips.sample_step(101) == 281  # right after attempt 2's last step (230 + 50)
    # back to the same checkpoint twice still adds up: (200, 50), then a failure at 230 from 200
    again = DataSkips(entries=[DataSkip(after_step=200, skip_steps=50)])
    assert data_skip_for(diag(bad=230), choice(200), skips=again).skip_steps == 30
