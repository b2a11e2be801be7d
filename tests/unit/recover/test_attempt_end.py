"""recover/attempt_end.py: how supervise tells a halt from a failure, and a job that started
from a command that failed before it, from the run's events."""

from __future__ import annotations

import json

from mscale.recover.attempt_end import halted_on_request, reached_the_job
from mscale.runs.rundir import RunDir


def test_a_bad_events_line_does_not_hide_the_attempts_own_records(tmp_path):
    """A line that is not JSON (a hand edit, a damaged disk) earlier in events.jsonl: the
    whole-file read gave no events at all, so supervise took a halt for a failure and a job
    that ran for one that never started (review, helper-79)."""
    t0 = 1_000_000.0
    start = {"time": t0 + 1, "source": "train", "kind": "start", "evidence": {"attempt": 2}}
    stop = {"time": t0 + 9, "source": "train", "kind": "stop", "evidence": {"code": 1}}
    (tmp_path / "events.jsonl").write_text(
        "NOT JSON\n" + "".join(json.dumps(e) + "\n" for e in (start, stop)))
    run = RunDir(str(tmp_path))
    assert reached_the_job(run, t0) and halted_on_request(run, t0)
    assert not reached_the_job(run, t0 + 100)
