"""watch/follow.py: the loop over small fakes of the feed and the judge (follow_fakes.py) — when
it stops, when it judges hangs, restarts, the checkpoint wait of --once, records of another size
than the layout. A live watch waiting for its run: test_follow_waiting.py; how a target and a
layout resolve: test_target.py."""

from __future__ import annotations

import json
import os
import time

import pytest

from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.watch.actions import Actor
from mscale.watch.findings import Finding
from mscale.watch.follow import Follower, JobState
from mscale.watch.target import layout_source, resolve_target

from tests.conftest import PLANS
from tests.unit.watch.follow_fakes import Feed, Judge, Out, event, hold_lock, make, recs, to_window


def test_live_stops_once_the_stop_is_seen_and_every_record_judged(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1, 2), [], recs(3)])
    event(rd, "start")
    hold_lock(rd)
    naps = []

    def sleep(s):
        naps.append(s)
        if len(naps) == 3:
            event(rd, "stop")

    f.run(interval=0.5, sleep=sleep)
    assert judges[0].rows == [1, 2, 3] and f.records == 3
    assert naps == [0.5] * 3  # the pass that saw the stop read the last records; one more, empty


def test_hang_is_judged_only_while_the_job_is_alive(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1), [], []])
    event(rd, "start")
    f.poll()
    assert judges[0].hang_checks == 0  # no lock: the job is not running
    hold_lock(rd)
    f.poll()
    assert judges[0].hang_checks == 1
    event(rd, "stop")
    f.poll()
    assert judges[0].hang_checks == 1 and f.job.stopped


def test_hang_is_judged_from_the_newest_attempts_start(tmp_path):
    # the judge must know when the newest attempt started: a relaunch still loading is
    # silent since its start, not since the previous attempt's last record
    f, rd, judges = make(tmp_path, [recs(1)])
    event(rd, "start", attempt=2)
    hold_lock(rd)
    f.poll()
    assert judges[0].attempt_start == f.job.started["time"] > f.feed.last_record_time


def test_a_metrics_file_alone_counts_as_alive_only_when_followed_live(tmp_path):
    assert JobState(None, follows_live=True, clock=time.time).alive()
    assert not JobState(None, follows_live=False, clock=time.time).alive()


def test_restart_starts_a_fresh_judge(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1, 2, 3), recs(1, 2)], restart_at={2})
    f.poll()
    f.poll()
    assert len(judges) == 2 and judges[1].rows == [1, 2] and f.restarts == 1


def test_summary_keeps_the_worst_of_an_attempt_before_a_restart(tmp_path):
    # A slow node found in attempt 1, then the job relaunched without it: the exit code is 2,
    # and so must the summary's worst be (it read "ok" from the fresh judge of attempt 2).
    slow = Finding(kind="straggler", severity="critical", message="node3 slow link",
                   cause="slow_link", ranks=[4, 5], nodes=["node3"], first_step=3, last_step=3)
    f, rd, judges = make(tmp_path, [recs(1, 2, 3), recs(1, 2)], emit={3: slow},
                         restart_at={2})
    f.poll()
    f.poll()
    assert len(judges) == 2 and f.findings == [slow]
    s = f.summary()
    assert s["worst"] == "critical" and s["emitted"] == {"straggler": 1}
    assert s["findings_total"] == 1


def test_once_judges_what_is_there_and_needs_records(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1, 2)], live=False)
    f.run(interval=1, sleep=lambda s: pytest.fail("--once must not sleep"))
    assert judges[0].rows == [1, 2]
    empty, _, _ = make(tmp_path / "b", [], live=False)
    with pytest.raises(MscaleError, match="no metrics records"):
        empty.run(interval=1, sleep=lambda s: None)


def test_once_waits_for_the_requested_checkpoint_before_quarantining(tmp_path):
    slow = Finding(kind="straggler", severity="warning", message="rank 3 slow",
                   cause="slow_device", ranks=[3], nodes=["node1"], first_step=2, last_step=2)
    # named nodes: a layout of placeholders (no plan, no --hostlist) never quarantines
    f, rd, _ = make(tmp_path, [recs(1, 2)], live=False, emit={2: slow}, hostlist="node[0-1]")
    event(rd, "start")
    hold_lock(rd)
    naps = []

    def sleep(s):
        naps.append(s)
        assert not os.path.exists(rd.quarantine)
        if len(naps) == 2:
            event(rd, "checkpoint", step=3)

    f.run(interval=0.25, sleep=sleep)
    assert os.path.exists(rd.path("control", "checkpoint")) and len(naps) == 2
    [entry] = json.loads(open(rd.quarantine).read())["entries"]
    assert entry["node"] == "node1" and entry["evidence"]["checkpoint_confirmed"]


def test_a_finding_that_closed_is_recorded_as_cleared(tmp_path):
    link = Finding(kind="straggler", severity="warning", message="a link is slow",
                   cause="slow_link", first_step=2, last_step=2, evidence={"suspects": ["a"]})
    f, rd, _ = make(tmp_path, [recs(1, 2), recs(3, 4)], emit={2: link}, clear={4: link})
    event(rd, "start")
    hold_lock(rd)
    f.run(interval=0.25, sleep=lambda s: event(rd, "stop"))
    said = [e["message"] for e in map(json.loads, open(rd.events)) if e["source"] == "watch"]
    assert said == ["a link is slow", "cleared after step 2: a link is slow"]


def test_records_of_another_size_than_the_layout_are_bad_input(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    target = resolve_target(rd.root)
    f = Follower(target=target, layout_for=layout_source(target), make_watcher=Judge,
                 feed=Feed([recs(1, world=4)]), events=None, to_window=to_window,
                 actor=Actor(None), outputs=Out(), live=False)
    with pytest.raises(MscaleError, match="the records have 4 ranks and plan.yaml 8") as e:
        f.poll()
    assert e.value.file == rd.path("plans")  # where the plan of that size would be


def test_ctrl_c_ends_a_live_watch_cleanly(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1, 2), recs(3)])

    def sleep(s):
        raise KeyboardInterrupt

    f.run(interval=1, sleep=sleep)  # returns: the outputs are still written by the caller
    assert judges[0].rows == [1, 2] and not f.job.stopped
