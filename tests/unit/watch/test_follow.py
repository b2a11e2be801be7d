"""watch/follow.py: the loop over small fakes of the feed and the judge — when it stops, when it
judges hangs, restarts, the checkpoint wait of --once — and how a target and a layout resolve."""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np
import pytest

from mscale.errors import MscaleError
from mscale.runs.atomic import append_line
from mscale.runs.rundir import RunDir
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.findings import Finding
from mscale.watch.follow import EventFeed, Follower, JobState
from mscale.watch.judge import SEVERITY
from mscale.watch.stream import MetricsFeed, records_to_window
from mscale.watch.target import layout_source, require_run, resolve_target
from mscale.watch.window import PER_RANK, SCALARS, Window

from tests.conftest import PLANS


class Feed:
    def __init__(self, batches, restart_at=()):
        self.batches, self.restart_at, self.polls = list(batches), set(restart_at), 0
        self.last_record_time, self.restarted, self.caught_up = None, False, True

    def poll(self):
        self.polls += 1
        self.restarted = self.polls in self.restart_at
        out = self.batches.pop(0) if self.batches else []
        if out:
            self.last_record_time = 1.0
        return out


class Judge:
    def __init__(self, layout, emit=None):
        self.layout, self.emit, self.rows, self.hang_checks = layout, emit or {}, [], 0
        self.escalated = []

    def feed(self, window):
        self.rows += window.steps.tolist()
        return [f for step, f in self.emit.items() if step in window.steps.tolist()]

    def check_hang(self, now, last, attempt_start=None):
        self.hang_checks += 1
        self.attempt_start = attempt_start
        return []

    def open_findings(self):
        return []

    def summary(self):  # as the real judge's: of its own attempt only
        mine = [f for step, f in self.emit.items() if step in self.rows]
        return {"rows": len(self.rows), "emitted": {f.kind: 1 for f in mine},
                "worst": max((f.severity for f in mine), key=SEVERITY.get, default="ok")}


class Out:
    def __init__(self):
        self.polls = []

    def poll(self, follower, window, new):
        self.polls.append((None if window is None else window.steps.tolist(), list(new)))


def to_window(records, world=None):
    n, w = len(records), world or len(records[0]["step_time"])
    return Window(np.array([r["step"] for r in records]), np.ones((n, len(PER_RANK), w)),
                  np.zeros((n, len(SCALARS))), [{} for _ in records])


def recs(*steps, world=4):
    return [{"step": s, "step_time": [1.0] * world} for s in steps]


def make(tmp_path, batches, live=True, run=True, emit=None, restart_at=(), hostlist=None,
         **actor_kw):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    target = resolve_target(rd.root if run else rd.metrics)
    judges = []

    def make_watcher(layout):
        judges.append(Judge(layout, emit))
        return judges[-1]

    f = Follower(target=target, layout_for=layout_source(target, hostlist=hostlist),
                 make_watcher=make_watcher,
                 feed=Feed(batches, restart_at), events=EventFeed(rd.events) if run else None,
                 to_window=to_window, actor=Actor(target.run, ActionConfig(**actor_kw)),
                 outputs=Out(), live=live)
    return f, rd, judges


def hold_lock(rd: RunDir) -> None:
    now = time.time()
    (open(rd.lock, "w")).write(json.dumps({
        "run_id": "r", "host": socket.gethostname(), "pid": os.getpid(), "since": now,
        "heartbeat": now, "lease_s": 120.0, "token": "t"}))


def event(rd, kind, **kw):
    append_line(rd.events, json.dumps({"source": "train", "kind": kind, "time": time.time(),
                                       **kw}))


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


def test_resolve_target(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    assert resolve_target(rd.root).run == rd and resolve_target(rd.root).plan_now() is None
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert resolve_target(rd.metrics).run is None  # no plan beside it: a file alone
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    t = resolve_target(rd.metrics)
    assert t.run == rd and t.plan_now() == rd.plan
    other = tmp_path / "trace.jsonl"
    other.write_text("")
    assert resolve_target(str(other)).run is None
    not_a_target = tmp_path / "notes.txt"
    not_a_target.write_text("")
    with pytest.raises(MscaleError) as e:
        resolve_target(str(not_a_target))
    assert e.value.file == str(not_a_target) and "not a run directory" in str(e.value)


def test_a_runs_event_log_is_refused_naming_the_run(tmp_path):
    # `mscale watch RUN/events.jsonl`: read as metrics it failed on "a record has no integer
    # step" and pointed at the metrics schema; the error must say what the file is instead.
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "run" / "events.jsonl").write_text('{"kind": "start"}\n')
    with pytest.raises(MscaleError) as e:
        resolve_target(rd.events)
    assert e.value.file == rd.events and "event log" in e.value.message
    assert rd.root in e.value.fix and "metrics.jsonl" in e.value.fix


def test_a_path_that_does_not_exist_yet_is_resolved_by_its_name(tmp_path):
    """A live watch started before the job was scheduled: the run directory (or metrics file)
    it names does not exist yet. It resolves, so a live watch can wait for it."""
    later = tmp_path / "runs" / "live"
    t = resolve_target(str(later))
    assert t.run == RunDir(str(later)) and t.metrics == f"{later}/metrics.jsonl"
    assert not t.exists() and not t.is_run()
    f = resolve_target(str(tmp_path / "later.jsonl"))
    assert f.run is None and not f.exists() and not f.is_run()
    assert f.plan == f"{tmp_path}/plan.yaml"  # read once a job writes it (plan_now)


@pytest.mark.parametrize("name,what", [("missing", "no such run directory or metrics file"),
                                       ("missing.jsonl", "no such metrics file")])
def test_once_refuses_a_path_that_does_not_exist(tmp_path, name, what):
    """--once judges what is there: nothing, at a path that does not exist, is an error naming
    the path and the fix, not a wait."""
    bad = tmp_path / name
    with pytest.raises(MscaleError) as e:
        require_run(resolve_target(str(bad)))
    assert e.value.file == str(bad) and e.value.message == what
    assert "check the path" in e.value.fix and "without --once" in e.value.fix
    assert not bad.exists()


def test_layout_from_plan_flags_or_flat(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    target = resolve_target(rd.root)
    plan = layout_source(target)(8)
    assert (plan.tp, plan.pp, plan.dp, plan.world) == (2, 2, 2, 8)
    flags = layout_source(target, tp=2, hostlist="gpu[1-4]")(8)
    assert (flags.tp, flags.pp, flags.dp, flags.ranks_per_node) == (2, 2, 2, 2)
    assert flags.node_name(7) == "gpu4" and flags.vpp == plan.vpp
    flat = layout_source(resolve_target(str(tmp_path)))(6)
    assert (flat.dp, flat.world) == (6, 6)
    alone = layout_source(resolve_target(str(tmp_path)), tp=2)(8)  # no plan: the flags alone
    assert (alone.tp, alone.pp, alone.dp, alone.named) == (2, 1, 4, False)


def test_a_flag_over_a_plan_replaces_its_field_only(tmp_path):
    """`--tp 2` over a tp2·pp2·dp2 plan put every rank on one placeholder node with pp 1, and
    a slow link was blamed on "node0"; the rest of the plan's layout and its nodes stay."""
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    target = resolve_target(rd.root)
    plan = layout_source(target)(8)
    same = layout_source(target, tp=2)(8)
    assert same == plan and same.named
    deeper = layout_source(target, pp=1)(8)
    assert (deeper.tp, deeper.pp, deeper.dp, deeper.stage_layers) == (2, 1, 4, None)
    assert deeper.node_names == plan.node_names and deeper.named
    refilled = layout_source(target, ranks_per_node=4)(8)  # ranks fill nodes otherwise
    assert refilled.ranks_per_node == 4 and not refilled.named
    renamed = layout_source(target, hostlist="gpu[1-4]")(8)  # the plan's 2 a node, renamed
    assert renamed.ranks_per_node == 2 and renamed.node_name(3) == "gpu2" and renamed.named
    for extra in ({}, {"ranks_per_node": 2}):  # which 4 of the 8 ran is not known
        with pytest.raises(MscaleError, match="the hostlist names 8 nodes, the layout needs 4"):
            layout_source(target, hostlist="gpu[1-8]", **extra)(8)
    wider = layout_source(target, dp=4)(16)
    assert wider.micro_batches == plan.micro_batches // 2 and wider.vpp == plan.vpp
    smaller = layout_source(target, tp=2, pp=2)(4)  # records of another job than the plan's
    assert smaller.dp == 1 and not smaller.named  # node1 may not be where they ran


def test_flags_set_a_damaged_plan_aside_and_say_so(tmp_path):
    """Flags are the way to watch a run whose plan.yaml does not load; without them it is an
    error, as before."""
    from mscale.errors import MscaleError

    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text("layout: [unclosed\n")
    with pytest.raises(MscaleError):
        layout_source(resolve_target(rd.root))
    said = []
    layout = layout_source(resolve_target(rd.root), tp=2, pp=2, hostlist="gpu[1-4]",
                           note=said.append)(8)
    assert (layout.tp, layout.pp, layout.dp, layout.node_name(7)) == (2, 2, 2, "gpu4")
    assert len(said) == 1 and "set aside" in said[0] and "the flags alone" in said[0]


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


def test_a_plan_written_after_watch_started_lays_out_the_records(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    layout_for = layout_source(resolve_target(rd.root))  # train has not written plan.yaml yet
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    layout = layout_for(8)
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2) and layout.node_name(7) == "node4"


def test_ctrl_c_ends_a_live_watch_cleanly(tmp_path):
    f, rd, judges = make(tmp_path, [recs(1, 2), recs(3)])

    def sleep(s):
        raise KeyboardInterrupt

    f.run(interval=1, sleep=sleep)  # returns: the outputs are still written by the caller
    assert judges[0].rows == [1, 2] and not f.job.stopped


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
        f"waiting for a run in {empty}: no plan.yaml, lock.json, metrics.jsonl or events.jsonl yet (0 s)",
        f"waiting for a run in {empty}: no plan.yaml, lock.json, metrics.jsonl or events.jsonl yet (6 s)",
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
        f"waiting for a run in {later}: no plan.yaml, lock.json, metrics.jsonl or events.jsonl yet (12 s)",
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


def test_once_refuses_a_directory_no_run_has_written_to(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MscaleError) as e:
        require_run(resolve_target(str(empty)))
    assert e.value.file == str(empty) and "plan.yaml, lock.json, metrics.jsonl or events.jsonl" in str(e.value)
    assert "without --once" in e.value.fix
    for name in ("lock.json", "plan.yaml", "metrics.jsonl"):  # any one of them makes a run
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        (d / name).write_text("")
        require_run(resolve_target(str(d)))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    require_run(resolve_target(str(trace)))


def test_flags_that_do_not_divide_the_records_ranks_say_so(tmp_path):
    target = resolve_target(str(tmp_path / "trace.jsonl"))
    with pytest.raises(MscaleError, match=r"--tp 3 x --pp 1 = 3 does not divide the records' "
                                          r"1024 ranks") as e:
        layout_source(target, tp=3)(1024)
    assert e.value.field == "--tp" and "tp·pp·dp = 1024" in e.value.fix
