"""watch/liveness.py through the CLI: the line of a job gone without recording its end names the
step and time of the attempt that died, not of one before it."""

from __future__ import annotations

import shutil
import time

from mscale.runs.rundir import RunDir

from tests.conftest import PLANS
from tests.unit.watch.ending_runs import append_metrics, event, once, records, verdict


def test_a_relaunched_attempt_gone_is_dated_by_its_own_last_step(cli, tmp_path):
    """Attempt 1 ran steps 1-15, attempt 2 resumed at 11 and ran to 30, then the whole job was
    killed and lock.json removed. A --once read gets the attempts in two polls (the feed holds
    the second's records for the next one), and the death was dated at the first: 'attempt 2
    ended ... after step 15', attempt 1's last step, with attempt 2's last record's time."""
    run = RunDir(str(tmp_path / "run"))
    run.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", run.plan)
    now = time.time()
    for attempt, begun in ((1, now - 1800), (2, now - 1200)):
        event(run, kind="start", time=begun, message="training",
              evidence={"run_id": f"local-{attempt}", "attempt": attempt})
    first, second = records(1, 15), records(11, 30, seed=2)
    for r in first:
        r["time"] = now - 1500
    for r in second:
        r["time"] = now - 600
    append_metrics(run, first + second)
    code, lines, err = once(cli, run)
    assert code == 2, err
    assert lines[-1].startswith("CRITICAL job stopped: attempt 2 ended without recording its "
                                "end after step 30 (its last record "), lines
    assert "10 min ago" in lines[-1]
    assert verdict(cli, run)["summary"]["job"]["step"] == 30
