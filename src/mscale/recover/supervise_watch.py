"""watch, in-process, for one attempt of a supervised job (`mscale.recover.supervise`).

The same parts ``mscale watch RUN`` wires (`mscale.cli.watch`): the metrics feed, the event feed,
the judge and the actor that turns a hardware straggler into checkpoint-then-quarantine. Two
differences: each attempt gets a fresh follower whose metrics feed starts at the end of what
earlier attempts wrote (a resumed job after a halt continues the step count, and may run a new
layout on fewer ranks, which one window must not mix), and findings are printed as one line each
on stderr beside the job's own output instead of a live view.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.config import WatchConfig
from mscale.watch.follow import EventFeed, Follower
from mscale.watch.target import Target, layout_source, plan_hints
from mscale.watch.judge import Watcher
from mscale.watch.stream import MetricsFeed, records_to_window


class LineOutputs:
    """One stderr line per new finding (implements `mscale.watch.follow.Outputs`)."""

    def poll(self, follower, window, new) -> None:  # noqa: ARG002 - protocol signature
        for f in new:
            where = f" on {', '.join(f.nodes)}" if f.nodes else ""
            print(f"recover supervise: watch: {f.kind} ({f.severity}){where}: {f.message}",
                  file=sys.stderr, flush=True)


def parse_watch_settings(pairs: list[str]) -> dict:
    """``NAME=VALUE`` pairs into WatchConfig overrides, typed as each field's default."""
    known = {f.name: f for f in dataclasses.fields(WatchConfig)}
    out: dict = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in known:
            raise MscaleError(f"unknown watch setting {pair!r}", field="--watch-set",
                              fix=f"use NAME=VALUE with NAME one of {', '.join(sorted(known))}")
        default = known[name].default
        try:
            out[name] = int(raw) if isinstance(default, int) else float(raw)
        except ValueError:
            raise MscaleError(f"{name} needs a number (got {raw!r})", field="--watch-set",
                              fix=f"e.g. --watch-set {name}=8") from None
    WatchConfig(**out)  # a bad value fails now, before the job starts
    return out


def make_follower(run: RunDir, settings: dict, ckpt_wait_s: float) -> Follower:
    """A follower for the attempt about to start (module docstring)."""
    target = Target(run.root, run.metrics, run, run.plan)
    feed = MetricsFeed(run.metrics)
    while True:  # what is there now belongs to earlier attempts
        feed.poll()
        if feed.caught_up:
            break
    feed.last_record_time = None  # no hang is judged before this attempt's first record

    def make_watcher(layout):
        return Watcher(layout, WatchConfig(**{**plan_hints(target, False), **settings}))

    return Follower(target=target, layout_for=layout_source(target), make_watcher=make_watcher,
                    feed=feed, events=EventFeed(run.events), to_window=records_to_window,
                    actor=Actor(run, ActionConfig(act=True, ckpt_wait_s=ckpt_wait_s)),
                    outputs=LineOutputs(), live=True, clock=time.time)
