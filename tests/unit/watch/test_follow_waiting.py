"""A live watch started before its run exists (watch/follow.py): never silent, it says what it
waits for every ``note_every_s`` (by an injected clock: no test waits for real), through the
directory appearing and the job starting; it creates nothing where the job will write, and a
Ctrl-C before any run appeared says so and exits 0."""

from __future__ import annotations

import pytest

from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.follow import EventFeed, Follower
from mscale.watch.stream import MetricsFeed, records_to_window
from mscale.watch.target import layout_source, resolve_target

from tests.conftest import PLANS
from tests.unit.watch.follow_fakes import Feed, Judge, Out, recs, to_window

NO_RUN_FILES = "plan.yaml, lock.json, metrics.jsonl or events.jsonl"
"""What a directory no run has written to lacks, as the waiting line names it."""


def _waiting_follower(target, batches, clock, notes, every=5.0):
    return Follower(target=target, layout_for=layout_source(target),
                    make_watcher=lambda layout: Judge(layout), feed=Feed(batches),
                    events=EventFeed(target.run.events) if target.run else None,
                    to_window=to_window, actor=Actor(None), outputs=Out(), live=True,
                    clock=clock, note=notes.append, note_every_s=every)


def _scripted_sleep(now: list[float], stop_at: int, at: dict):
    """A sleep for `Follower.run` that advances the injected clock 2 s per nap, runs
    ``at[n]`` on the n-th nap (the job appearing, step by step) and ends with Ctrl-C on nap
    ``stop_at``."""
    naps = []

    def sleep(s):
        naps.append(s)
        now[0] += 2.0
        at.get(len(naps), lambda: None)()
        if len(naps) == stop_at:
            raise KeyboardInterrupt

    return sleep


def test_a_live_watch_of_an_empty_directory_says_what_it_waits_for(tmp_path):
    """Never silent: at the first look and then every note_every_s (by the injected clock, no
    real waiting), one line; it changes once the run appears, and stops once records come."""
    empty = tmp_path / "empty"
    empty.mkdir()
    now = [100.0]
    notes: list[str] = []
    f = _waiting_follower(resolve_target(str(empty)), [[]] * 7 + [recs(1, world=8)],
                          lambda: now[0], notes)
    sleep = _scripted_sleep(now, stop_at=9, at={  # the job starts: train writes plan.yaml first
        4: lambda: (empty / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())})
    f.run(interval=2.0, sleep=sleep)
    assert notes == [
        f"waiting for a run in {empty}: no {NO_RUN_FILES} yet (0 s)",
        f"waiting for a run in {empty}: no {NO_RUN_FILES} yet (6 s)",
        f"waiting for the run's first step: no record in {empty}/metrics.jsonl yet (12 s)",
    ]  # looks at 0, 2, 4, ... s; the record of the 8th look (14 s) silences the rest


def test_a_metrics_file_not_yet_written_to_is_waited_for_too(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("")
    notes: list[str] = []
    f = _waiting_follower(resolve_target(str(path)), [], lambda: 0.0, notes)

    def sleep(s):
        raise KeyboardInterrupt

    f.run(interval=1.0, sleep=sleep)
    assert notes == [f"waiting for the first record in {path} (0 s)",
                     f"stopped before the first record in {path}: nothing judged"]


def _real_follower(target, clock, notes):
    """A live follower with the real feeds and a real actor (allowed to act): what the CLI
    builds, but with an injected clock, so no test waits for real."""
    return Follower(target=target, layout_for=layout_source(target), make_watcher=Judge,
                    feed=MetricsFeed(target.metrics),
                    events=EventFeed(target.run.events) if target.run else None,
                    to_window=records_to_window, actor=Actor(target.run, ActionConfig()),
                    outputs=Out(), live=True, clock=clock, note=notes.append)


def test_a_live_watch_waits_for_a_run_directory_that_does_not_exist_yet(tmp_path):
    """Started before the scheduler placed the job: it says what it waits for, naming the path
    (a typo shows), every note_every_s, through the directory appearing and the job starting,
    and creates nothing where the job will write."""
    later = tmp_path / "runs" / "live"
    now = [100.0]
    notes: list[str] = []
    f = _real_follower(resolve_target(str(later)), lambda: now[0], notes)
    def untouched():
        assert not (tmp_path / "runs").exists()  # watch made nothing of the path

    sleep = _scripted_sleep(now, stop_at=10, at={
        1: untouched, 2: untouched, 3: untouched,
        4: lambda: later.mkdir(parents=True),  # the job is scheduled: its directory appears
        7: lambda: (later / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())})
    f.run(interval=2.0, sleep=sleep)
    assert notes == [
        f"waiting for a run in {later}: no such directory yet (0 s)",
        f"waiting for a run in {later}: no such directory yet (6 s)",
        f"waiting for a run in {later}: no {NO_RUN_FILES} yet (12 s)",
        f"waiting for the run's first step: no record in {later}/metrics.jsonl yet (18 s)",
        f"stopped before the first record in {later}/metrics.jsonl: nothing judged",
    ]  # a run had appeared when Ctrl-C came, without a step: the line says so
    assert sorted(p.name for p in later.iterdir()) == ["plan.yaml"]


@pytest.mark.parametrize("made", [None, "dir"])
def test_ctrl_c_before_any_run_appeared_says_so(tmp_path, made):
    """Nothing judged, and the one line says why: no run ever appeared at that path (none there,
    or an empty directory)."""
    later = tmp_path / "runs" / "live"
    if made:
        later.mkdir(parents=True)
    notes: list[str] = []
    f = _real_follower(resolve_target(str(later)), lambda: 0.0, notes)

    def sleep(s):
        raise KeyboardInterrupt

    f.run(interval=1.0, sleep=sleep)
    assert notes[-1] == f"stopped before any run appeared in {later}" and len(notes) == 2
    assert f.records == 0 and f.findings == []


def test_a_metrics_file_that_does_not_exist_yet_is_waited_for(tmp_path):
    path = tmp_path / "later.jsonl"
    notes: list[str] = []
    f = _real_follower(resolve_target(str(path)), lambda: 0.0, notes)

    def sleep(s):
        raise KeyboardInterrupt

    f.run(interval=1.0, sleep=sleep)
    assert notes == [f"waiting for the first record in {path}: no such file yet (0 s)",
                     f"stopped before any run appeared in {path}"]


def test_the_cli_waits_live_and_exits_0_on_ctrl_c_before_any_run(cli, tmp_path, monkeypatch):
    """`mscale watch runs/live` before the job exists: a wait (not exit 3), and Ctrl-C ends it
    with the line and the exit code of nothing judged (docs/watch.md); the path stays unmade."""
    later = tmp_path / "runs" / "live"
    polls = []
    real = Follower.poll

    def poll(self):
        polls.append(1)
        if len(polls) == 3:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Follower, "poll", poll)
    code, out, err = cli("watch", str(later), "--interval", "0.05")
    assert (code, out) == (0, ""), err
    assert err.splitlines() == [f"waiting for a run in {later}: no such directory yet (0 s)",
                                f"stopped before any run appeared in {later}"]
    assert not (tmp_path / "runs").exists()
