"""How a live watch ends with the job (watch/ending.py through watch/follow.py): the end is its
last word in text, JSON and JSONL, a clean finish exits 0, and a relaunch's start withdraws the
end; recover's supervisor builds followers that leave the end to itself."""

from __future__ import annotations

import json
import os

from mscale.watch.follow import Follower

from tests.unit.watch.ending_runs import (KILLED, follower, launcher_failure, own_stop, running,
                                          start)


def _stop_after(monkeypatch, polls: int, write) -> None:
    """Run ``write`` (the job's end) once the live watch has looked ``polls`` times."""
    real, seen = Follower.poll, []

    def poll(self):
        seen.append(1)
        if len(seen) == polls:
            write()
        return real(self)

    monkeypatch.setattr(Follower, "poll", poll)


def test_a_live_watch_says_the_job_stopped_and_why(cli, rd, monkeypatch):
    running(rd)
    _stop_after(monkeypatch, 3, lambda: launcher_failure(rd, 5, -9))
    code, out, err = cli("watch", rd.root, "--no-act", "--interval", "0.05")
    assert code == 2, out + err
    lines = out.splitlines()  # the status line came at the first look; the end is the last word
    assert lines[-1] == KILLED and lines[0].startswith("step 15 | loss"), out


def test_a_live_watch_json_and_jsonl_carry_the_end(cli, rd, monkeypatch):
    running(rd)
    _stop_after(monkeypatch, 2, lambda: own_stop(rd, 2, 15, "nan", "loss nan"))
    code, out, err = cli("watch", rd.root, "--no-act", "--interval", "0.05", "--jsonl")
    [stop] = [json.loads(x) for x in out.splitlines()]
    assert code == 2 and stop["kind"] == "stop" and stop["cause"] == "nan", err
    code, out, err = cli("watch", rd.root, "--no-act", "--interval", "0.05", "--json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 2 and doc["summary"]["worst"] == "critical"


def test_a_live_watch_of_a_clean_finish_exits_0(cli, rd, monkeypatch):
    running(rd)
    _stop_after(monkeypatch, 2, lambda: own_stop(rd, 0, 15))
    code, out, err = cli("watch", rd.root, "--no-act", "--interval", "0.05")
    assert code == 0 and "job stopped" not in out, out + err
    assert out.splitlines()[-2].endswith("open alerts 0")
    assert out.splitlines()[-1].startswith("OK job finished at step 15")


def test_a_clean_finish_under_jsonl_is_said_on_stderr_only(cli, rd):
    """stdout's lines are findings only (a log shipper's contract), so a healthy finished job
    prints none there; its verdict went nowhere, and a CI log of `--once --jsonl` was empty."""
    running(rd)
    own_stop(rd, 0, 15)
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--jsonl")
    assert code == 0 and out == "", out
    assert err.splitlines()[-1].startswith("OK job finished at step 15 (attempt 1, exit 0)"), err
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--json")
    assert code == 0 and json.loads(out)["summary"]["job"]["state"] == "finished"
    assert "job finished" not in err  # the document carries it


def test_a_job_still_running_is_said_to_be(cli, rd):
    """`--once` mid-run ended on the status line, as a finished job's output once had: a CI step
    could not tell a job still training from one that had finished. A job whose lock is gone
    without a stop is no longer running (a `died` end), and says nothing of the kind."""
    running(rd)
    code, out, err = cli("watch", rd.root, "--once", "--no-act")
    assert code == 0, out + err
    assert out.splitlines()[-1] == "OK job still running at step 15 (attempt 1); no open alerts"
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--jsonl")
    assert code == 0 and out == "" and err.splitlines()[-1].startswith("OK job still running")
    os.remove(rd.lock)
    code, out, err = cli("watch", rd.root, "--once", "--no-act")
    assert code == 2 and "still running" not in out + err, out + err


def test_a_start_after_the_end_withdraws_it(rd):
    f = follower(rd, report_end=True)
    launcher_failure(rd, 5, -9)
    f.poll()
    assert f.ended is not None and f.findings == [f.ended] and f.open_findings() == [f.ended]
    start(rd, 2)
    running(rd, 2)
    f.poll()
    assert f.ended is None and f.findings == [] and f.summary()["job"] is None


def test_recovers_supervisor_leaves_the_end_to_itself(rd):
    """supervise builds followers without report_end: the old attempt's stop is no finding."""
    f = follower(rd, report_end=False)
    launcher_failure(rd, 5, -9)
    f.poll()
    assert f.ended is None and f.findings == [] and "job" not in f.summary()
