"""How watch judges a job's end that nobody recorded (watch/ending.py with watch/liveness.py):
the run's lock decides: a dead holder or no lock at all after a start is a job gone (CRITICAL,
exit 2), a live one or a heartbeat that comes back is no death, and a stop written just before
the lock is let go is a finish."""

from __future__ import annotations

import shutil
import time

import pytest

from mscale.runs.rundir import RunDir

from tests.conftest import PLANS
from tests.unit.watch.ending_runs import (append_metrics, event, follower, once, own_stop,
                                          records, verdict)


def test_a_job_gone_without_recording_its_end_is_critical(cli, rd):
    """torchrun's rank 0 SIGKILLed: no launcher writes a stop. Its lock's holder is dead: the
    job ended (exit 2), not a healthy run (exit 0)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "import os, sys; from mscale.runs.lock import RunLock;"
                    " RunLock(sys.argv[1], 'local-1').acquire(); os._exit(0)", rd.root],
                   check=True, timeout=60)
    doc = verdict(cli, rd)
    job = doc["summary"]["job"]
    # its own cause, not "crashed" (a failure someone saw and recorded, with its exit 3)
    assert doc["exit_code"] == 2 and job["state"] == "died", doc["summary"]
    assert "ended without recording its end" in job["reason"] and "no longer exists" in \
        job["reason"]
    [stop] = [f for f in doc["findings"] if f["kind"] == "stop"]
    assert stop["cause"] == "died" and "nothing recorded how it ended" in stop["advice"]


def test_a_death_is_withdrawn_when_the_holder_beats_again(rd):
    """A heartbeat late past its lease (a filesystem stall) read as dead for good (review)."""
    import json as _json

    from mscale.runs.lock import RunLock

    f = follower(rd, report_end=True)
    lock = RunLock(rd.root, "local-1").acquire()
    try:
        path = rd.path("lock.json")
        rec = _json.loads(open(path).read())
        stale = {**rec, "heartbeat": rec["heartbeat"] - 10_000}
        open(path, "w").write(_json.dumps(stale))
        f.poll()
        assert f.job.stopped and f.ended is not None and not f.job.alive()
        first = f.ended
        f.poll()
        assert f.ended is first  # the same death: one finding, not one a poll
        open(path, "w").write(_json.dumps(rec))  # it beats again
        f.poll()
        assert not f.job.stopped and f.ended is None and f.job.alive()
    finally:
        lock.release()


def test_a_live_lock_is_no_death_however_old_the_last_record(cli, rd):
    """A slow job is not a dead one: its lock's heartbeat is a thread of its own."""
    from mscale.runs.lock import RunLock

    with RunLock(rd.root, "local-1"):  # this process: alive
        assert verdict(cli, rd)["summary"]["job"] is None


@pytest.mark.parametrize("steps", [15, 0])
def test_a_start_without_a_stop_or_a_lock_is_a_job_gone(cli, tmp_path, steps):
    """The whole job SIGKILLed (launcher and ranks) or its node rebooted, and lock.json removed
    since (the lock's own refusal says to remove it once the job is dead): nothing holds the run,
    no stop was written. watch --once said "open alerts 0", exit 0; it says which attempt ended
    after which step, since when, and exits 2."""
    run = RunDir(str(tmp_path / "run"))
    run.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", run.plan)
    for attempt in (1, 2):  # attempt 1 crashed and was relaunched: attempt 2 is the newest
        event(run, kind="start", time=time.time() - 1200, message="training",
              evidence={"run_id": f"local-{attempt}", "attempt": attempt})
    recs = records(1, steps) if steps else []
    for r in recs:
        r["time"] = time.time() - 600  # ten minutes ago
    append_metrics(run, recs)
    code, lines, err = once(cli, run)
    assert code == 2, err
    when = ("after step 15 (its last record " if steps else "before its first step (started ")
    assert lines[-1].startswith(f"CRITICAL job stopped: attempt 2 ended without recording its "
                                f"end {when}"), lines
    assert lines[-1].endswith(f"no job holds the run directory ({run.lock} is gone)"), lines
    if steps:
        assert "10 min ago" in lines[-1]
    job = verdict(cli, run)["summary"]["job"]
    assert (job["state"], job["attempt"], job["exit_code"]) == ("died", 2, None)
    assert job["step"] == (15 if steps else None)


def test_a_stop_written_as_the_lock_is_let_go_is_no_death(rd, monkeypatch):
    """A job writes its stop, then releases its lock. A watch that read the events before the
    stop and the lock after the release must not call the finish a death."""
    from mscale.watch.liveness import JobState

    f = follower(rd, report_end=True)
    real = JobState.observe_death

    def job_finishes_meanwhile(self):
        if self.last == "start" and not self.stopped:
            own_stop(rd, 0, 15)  # the stop lands just before the lock is looked at
        real(self)

    monkeypatch.setattr(JobState, "observe_death", job_finishes_meanwhile)
    f.poll()
    assert f.job_end is not None and f.job_end.cause == "finished" and f.ended is None
