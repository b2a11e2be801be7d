"""What the run directory recorded of the attempt supervise just ran: whether it reached the
job at all, and whether it halted on request. Both are read from the records the job writes
(events.jsonl, the ranks' error files), dated after the launch, since the exit code alone cannot
tell a halt from a wrapper that failed, nor a job that failed from a command that never started
one (a typo in the plan's path exits 3 like a crash does).
"""

from __future__ import annotations

from mscale.errors import EXIT_WARNING
from mscale.recover.phases import read_events
from mscale.runs.rundir import RunDir
from mscale.train.failure import read_error_files

CLOCK_SLACK_S = 10.0
"""A record of the job may be dated this much before its launch (node clocks differ)."""


def halted_on_request(run: RunDir, since: float) -> bool:
    """Whether train itself recorded a stop with code 1 (a halt or a signal) after ``since``:
    exit 1 without that record is a launcher or a wrapper failing, recovered like any failure,
    not a request to stop."""
    for e in reversed(read_events(run)):
        when = e.get("time")
        if not isinstance(when, (int, float)) or when < since - CLOCK_SLACK_S:
            return False
        evd = e.get("evidence") if isinstance(e.get("evidence"), dict) else {}
        if e.get("source", "train") == "train" and e.get("kind") == "stop" and "code" in evd:
            return evd["code"] == EXIT_WARNING
    return False


def reached_the_job(run: RunDir, since: float) -> bool:
    """Whether anything of the job was recorded after ``since`` (the launch): a train event
    (a start, a launcher's stop, rank 0's refusal) or a rank's error file. Neither means the
    command failed before any process of the job ran (a wrong path, a bad flag, a launcher that
    could not start): relaunching it would fail the same way, and the run's older records are
    about an earlier attempt, not this failure."""
    for e in reversed(read_events(run)):
        when = e.get("time")
        if not isinstance(when, (int, float)) or when < since - CLOCK_SLACK_S:
            break
        if e.get("source", "train") == "train":
            return True
    return any(isinstance(r.get("time"), (int, float)) and r["time"] >= since - CLOCK_SLACK_S
               for r in read_error_files(run).values())
