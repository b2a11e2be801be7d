"""Small fakes of watch's follower parts (the feed, the judge, the outputs) and a `make` that
builds a `Follower` over them, for the tests of the follow loop (test_follow*.py, test_report.py).
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np

from mscale.runs.atomic import append_line
from mscale.runs.rundir import RunDir
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.follow import EventFeed, Follower
from mscale.watch.judge import SEVERITY
from mscale.watch.target import layout_source, resolve_target
from mscale.watch.window import PER_RANK, SCALARS, Window


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
    """``emit``: step -> the finding found at it; ``clear``: step -> the finding closed at it."""

    def __init__(self, layout, emit=None, clear=None):
        self.layout, self.emit, self.rows, self.hang_checks = layout, emit or {}, [], 0
        self.clear = clear or {}
        self.escalated, self.cleared = [], []

    def feed(self, window):
        self.rows += window.steps.tolist()
        self.cleared = [f for step, f in self.clear.items() if step in window.steps.tolist()]
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
         clear=None, **actor_kw):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    target = resolve_target(rd.root if run else rd.metrics)
    judges = []

    def make_watcher(layout):
        judges.append(Judge(layout, emit, clear))
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
