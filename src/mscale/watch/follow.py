"""The watch loop: read what the job appended, judge it, act, report; live or once.

One pass (`Follower.poll`) reads the new lines of ``events.jsonl`` first (job start/stop, the
checkpoint a quarantine waits for), then the new metrics records, judges them as one `Window`,
checks for a hang while the job is alive, acts, and hands the results to the outputs. Reading
events before metrics makes "the job stopped" safe to act on: the stop event is written after
the job's last record, so the metrics pass that follows it has seen every step.

Whether the job is alive, and whether it ended without recording it, is watch/liveness.py's.

How the newest attempt ended is judged too (``report_end``, the CLI): once the job's latest
lifecycle event is a ``stop`` or ``hang`` and every record before it is judged, an end other than
a clean finish (a killed rank, a crash, a hang, a NaN stop, a halt) becomes one finding of kind
``stop`` carrying the event's reason (watch/ending.py). A ``start`` after it (a relaunch) withdraws
it: the newest attempt is what the verdict is about.

Until the first record comes, a live watch says what it waits for (a path that does not exist
yet, a run to appear in an empty directory, the run's first step) at its first look and every
few seconds: a watch pointed at a wrong path must not follow it forever in silence, and one
started before the scheduler has placed the job must not fail. ``--once`` refuses a path that
does not exist and a directory no job has written to (`require_run`).

The parts are passed in (the feed, the judge, the actor, the outputs), so this loop is tested
with small fakes and its pieces with real traces.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from mscale.errors import MscaleError
from mscale.watch import ending
from mscale.watch.actions import Actor
from mscale.watch.ending import JobEnd
from mscale.watch.findings import Finding
from mscale.watch.history import AttemptHistory, History
from mscale.watch.judge import SEVERITY
from mscale.watch.layout import JobLayout
from mscale.watch.liveness import JobState
from mscale.watch.tail import JsonlTail
from mscale.watch.target import Target
from mscale.watch.window import Window

KEPT_ATTEMPTS = 4
"""Earlier attempts whose records the report keeps (each is a `History`: about 24 MB at 12,288
ranks). A run relaunched more often shows its newest ones and says how many it left out."""


class EventFeed:
    """New records of ``events.jsonl`` (tail.py `JsonlTail`: what was appended since the last
    poll, so a long run's events cost a watch nothing per poll, and an object store one request
    per new event, not one per event ever written); a replaced file is read from its start."""

    def __init__(self, url: str):
        self.tail = JsonlTail(url)

    def poll(self) -> list[dict]:
        records: list[dict] = []
        while True:
            new, _ = self.tail.read()
            records += new
            if self.tail.caught_up:
                return records


class Feed(Protocol):
    last_record_time: float | None
    restarted: bool

    def poll(self) -> list[dict]: ...


class Outputs(Protocol):
    def poll(self, follower: "Follower", window: Window | None, new: list[Finding]) -> None: ...


@dataclass
class Follower:
    """State of one watch session (module docstring)."""

    target: Target
    layout_for: Callable[[int, dict | None], JobLayout]
    """The layout for a job of this many ranks (from the plan, flags, or flat), given the
    ``start`` event of the attempt that wrote the records (None: unknown), whose nodes name the
    plan's under SLURM (watch/target.py `launched_names`)."""
    make_watcher: Callable[[JobLayout], object]
    feed: Feed
    events: EventFeed | None
    to_window: Callable[..., Window]
    actor: Actor
    outputs: Outputs
    live: bool = True
    clock: Callable[[], float] = time.time
    layout: JobLayout | None = None
    watcher: object | None = None
    history: History | None = None
    findings: list[Finding] = field(default_factory=list)
    """Every finding of this session, in the order found."""
    records: int = 0
    restarts: int = 0
    job: JobState = None
    note: Callable[[str], None] | None = None
    """Where a live watch says what it waits for while no record has come (the CLI: stderr).
    None: say nothing (recover's supervisor follows attempts it started itself)."""
    note_every_s: float = 5.0
    """Seconds between two such lines (by ``clock``): a watch is never silent for longer."""
    report_end: bool = False
    """Judge how the job's newest attempt ended (module docstring): the CLI. recover's supervisor
    judges the ends of the attempts it runs itself, and leaves it off."""
    ended: Finding | None = None
    """The ``stop`` finding of the newest attempt's abnormal end, while it stands."""
    job_end: JobEnd | None = None
    """How the newest attempt ended (a clean finish too), once judged."""
    earlier: list[AttemptHistory] = field(default_factory=list)
    """The attempts before the current one (the newest `KEPT_ATTEMPTS`), for the report."""
    attempts_dropped: int = 0
    """Earlier attempts no longer kept."""
    attempt: int | None = None
    """The current attempt's number (its start event), None when unknown."""
    _layout_start: dict | None = None
    """The ``start`` event of the attempt the current layout is for (`_start_of`)."""
    failed_saves: list[Finding] = field(default_factory=list)
    """The newest attempt's failed checkpoints (``report_end`` only), reported as the job's own
    record, like its end: never recorded again by the actor."""

    def __post_init__(self) -> None:
        self.job = JobState(self.target.run, self.live, self.clock)
        self._seeded = False
        self.rises: list[Finding] = []
        """Open findings whose severity rose in the last pass (judge.py), said once more."""

    def poll(self) -> int:
        """One pass (module docstring); returns how many new metrics records it judged."""
        saves = self._read_events()
        saves += self._observe_death()
        records = self.feed.poll()
        if getattr(self.feed, "restarted", False):
            self._restart()
        window, new, self.rises, cleared = None, [], [], []
        for part in self._by_attempt(records):
            if self.layout is not None and self._start_of(part) is not self._layout_start:
                self._restart()  # a relaunch whose steps go on: its start event says so
            window = self._window(part)
            new += self.watcher.feed(window)
            self.rises = self.watcher.escalated
            cleared += self.watcher.cleared
            self.history.add(window)
            self.records += len(part)
        if getattr(self.feed, "caught_up", True):  # held records of a later attempt: not yet
            self.job.date_death(getattr(self.watcher, "last_step", None),
                                self.feed.last_record_time)
        alive = self.job.alive()
        if alive and self.watcher is not None:
            start = (self.job.started or {}).get("time")
            new += self.watcher.check_hang(self.clock(), self.feed.last_record_time,
                                           start if isinstance(start, (int, float)) else None)
        self.findings += new
        # the job's own stop is its record: not handed to the actor
        self.actor.handle(new, alive, nodes_named=self.layout.named if self.layout else True)
        self.actor.escalate(self.rises)
        self.actor.clear(cleared)
        self.actor.tick(alive)
        new += self._failed_saves(saves)
        new += self._judge_end()
        self.outputs.poll(self, window, new)
        return len(records)

    def _judge_end(self) -> list[Finding]:
        """The newest attempt's end as a finding, once, after every record before it was judged
        (module docstring); returns it when it is new."""
        if not self.report_end:
            return []
        event = self.job.end_event if self.job.stopped else None
        if event is None:  # running, or relaunched since: an earlier end no longer stands
            if self.ended is not None:
                self.findings.remove(self.ended)
            self.ended = self.job_end = None
            return []
        if self.job_end is not None and self.job_end.event is event:
            return []
        if not getattr(self.feed, "caught_up", True):
            return []
        if self.ended is not None:
            self.findings.remove(self.ended)
        self.job_end = self.job.end()
        self.ended = self.job_end.finding(getattr(self.watcher, "last_step", None))
        if self.ended is None:
            return []
        self.findings.append(self.ended)
        return [self.ended]

    def _observe_death(self) -> list[dict]:
        """Look at the lock for a job gone without recording its end (liveness.py), then read
        the events again: a job writes its stop before it lets its lock go, so a stop (or a
        relaunch's start) that came between the two reads is seen, not taken for a death.
        Returns the ``start`` and ``checkpoint_failed`` events read again (`_read_events`)."""
        saves: list[dict] = []
        for _ in range(3):
            self.job.observe_death()
            if self.job.death is None:
                return saves
            before = (self.job.last, self.job.started)
            saves += self._read_events()
            if (self.job.last, self.job.started) == before:
                return saves
        self.job.death = None  # lifecycle events still coming: a job is writing them
        return saves

    def _read_events(self) -> list[dict]:
        """Read the new events; returns the job's ``start`` and ``checkpoint_failed`` among them
        (for `_failed_saves`)."""
        if self.events is None:
            return []
        evs = self.events.poll()
        if not self._seeded:
            self.actor.seed(evs)
            self._seeded = True
        self.job.observe(evs)
        self.actor.observe(evs)
        return [e for e in evs if e.get("source", "train") == "train"
                and e.get("kind") in ("start", "checkpoint_failed")]

    def _failed_saves(self, events: list[dict]) -> list[Finding]:
        """The newest attempt's failed checkpoints as findings; a ``start`` withdraws the
        earlier attempt's. Returns the new ones."""
        if not self.report_end:
            return []
        new = []
        for e in events:
            if e["kind"] == "start":
                gone = {id(f) for f in self.failed_saves}
                self.findings = [f for f in self.findings if id(f) not in gone]
                self.failed_saves, new = [], []
            else:
                new.append(ending.checkpoint_failure(e))
                self.failed_saves.append(new[-1])
        self.findings += new
        return new

    def _window(self, records: list[dict]) -> Window:
        try:
            window = self.to_window(records, self.layout.world if self.layout else None)
        except MscaleError as e:  # a record's own fault: name the file it is in
            e.file = e.file or self.target.metrics
            raise
        if self.layout is None:
            self._layout_start = self._start_of(records)
            self.layout = self.layout_for(window.world, self._layout_start)
            if self.layout.world != window.world:
                raise MscaleError(f"the records have {window.world} ranks, the layout "
                                  f"{self.layout.world}", file=self.target.metrics,
                                  fix="give the job's --tp/--pp/--dp (or its plan.yaml)")
            self.watcher = self.make_watcher(self.layout)
        if self.history is None or self.history.world != window.world:
            if self.history is not None:
                self._keep_attempt()
            self.history = History(window.world)
            self.attempt = self._attempt_of(records)
        return window

    def _by_attempt(self, records: list[dict]) -> list[list[dict]]:
        """``records`` cut where a ``start`` event falls between two of them. The feed cuts
        where a step goes back or the ranks change; a relaunch that resumes at the step after
        its checkpoint (a preemption's requeue) changes neither, but may run on other nodes:
        judged on the attempt before's layout, a slow rank on the new node was named, and
        quarantined, as the node it replaced."""
        starts = sorted(s["time"] for s in self.job.starts
                        if isinstance(s.get("time"), (int, float)))
        parts, begin, before = [], 0, None
        for i, r in enumerate(records):
            t = r.get("time")
            if not isinstance(t, (int, float)) or not starts:
                continue
            k = bisect.bisect_right(starts, t)  # how many starts precede this record
            if before is not None and k != before:
                parts.append(records[begin:i])
                begin = i
            before = k
        return [p for p in parts + [records[begin:]] if p]

    def _start_of(self, records: list[dict]) -> dict | None:
        """The ``start`` event of the attempt that wrote ``records``: the newest one written
        before its first record (the events are read before the metrics)."""
        t = records[0].get("time") if records else None
        if not isinstance(t, (int, float)):
            return None
        before = [s for s in self.job.starts if isinstance(s.get("time"), (int, float))
                  and s["time"] <= t]
        return before[-1] if before else None

    def _attempt_of(self, records: list[dict]) -> int | None:
        """The number of the attempt that wrote ``records`` (its `_start_of` event's)."""
        n = ((self._start_of(records) or {}).get("evidence") or {}).get("attempt")
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def _keep_attempt(self) -> None:
        """The attempt that ended keeps its curves and heat maps for the report, the newest
        `KEPT_ATTEMPTS` of them: watch's memory stays bounded over any number of relaunches."""
        self.earlier.append(AttemptHistory(self.attempt, self.history, self.layout))
        if len(self.earlier) > KEPT_ATTEMPTS:
            self.earlier.pop(0)
            self.attempts_dropped += 1

    def attempts(self) -> list[AttemptHistory]:
        """The attempts the report shows, oldest first, the current one last."""
        now = [AttemptHistory(self.attempt, self.history, self.layout)] if self.history else []
        return self.earlier + now

    def _restart(self) -> None:
        """The job restarted in the same run directory: judge the new attempt from scratch
        (its layout may differ: the plan is read again)."""
        self.restarts += 1
        if self.history is not None:
            self._keep_attempt()
        self.layout = self.watcher = self.history = None

    def _note_waiting(self, since: float, noted: float | None) -> float | None:
        """While no record has come, one line saying what watch waits for, at the first look and
        then every ``note_every_s``; returns when it last said so. Without it a watch pointed at
        a wrong or empty directory would follow it forever without a word."""
        if self.note is None or self.records:
            return noted
        now = self.clock()
        if noted is not None and now - noted < self.note_every_s:
            return noted
        self.note(f"{self.target.waiting_for()} ({now - since:.0f} s)")
        return now

    def _note_stopped_early(self) -> None:
        """Ctrl-C before the first record: the exit code says nothing was wrong, which is true
        of nothing judged; this line says why there was nothing to judge (no run at the path
        yet, or a run that had not finished its first step)."""
        if self.note is None or self.records:
            return
        if not self.target.is_run():
            self.note(f"stopped before any run appeared in {self.target.url}")
        else:
            self.note(f"stopped before the first record in {self.target.metrics}: nothing "
                      "judged")

    def open_findings(self) -> list[Finding]:
        """The judge's open findings, and the job's abnormal end while it stands."""
        found = list(self.watcher.open_findings()) if self.watcher is not None else []
        return found + ([self.ended] if self.ended is not None else [])

    def summary(self) -> dict:
        base = dict(self.watcher.summary()) if self.watcher is not None else {}
        out = {**base, "records": self.records, "restarts": self.restarts,
               "findings_total": len(self.findings)}
        # `worst` and `emitted` are the session's, as the exit code is: the judge of a restart
        # starts afresh, and a slow node found in the attempt before the relaunch without it
        # left a summary saying "ok" under exit code 2. self.findings holds every finding of
        # the session (the job's end and failed saves included while they stand).
        emitted: dict[str, int] = {}
        for f in self.findings:
            emitted[f.kind] = emitted.get(f.kind, 0) + 1
        out["emitted"] = emitted
        out["worst"] = max([out.get("worst", "ok")] + [f.severity for f in self.findings],
                           key=SEVERITY.get)
        if self.report_end:
            out["job"] = self.job_end.as_dict() if self.job_end is not None else None
        if self.ended is not None:  # the verdict counts the job's end like any finding
            out["worst_open"] = max(out.get("worst_open", "ok"), self.ended.severity,
                                    key=SEVERITY.get)
            out["open"] = out.get("open", 0) + 1
        return out

    def run(self, interval: float, sleep: Callable[[float], None] = time.sleep) -> None:
        """Live: poll until the job's stop is seen and judged (or Ctrl-C). Once: one pass,
        then wait (bounded) for a checkpoint a quarantine depends on."""
        since, noted = self.clock(), None
        try:
            while True:
                got = self.poll()
                if not self.live and getattr(self.feed, "caught_up", True):
                    break
                if self.job.stopped and not got and not self.actor.pending:
                    break
                noted = self._note_waiting(since, noted)
                if getattr(self.feed, "caught_up", True):
                    sleep(interval)
            while self.actor.pending:
                sleep(interval)
                self._read_events()
                self.actor.tick(self.job.alive())
        except KeyboardInterrupt:
            self._note_stopped_early()
        if not self.live and not self.records and self.ended is None:
            raise MscaleError("no metrics records to judge", file=self.target.metrics,
                              fix="point watch at a run that has written steps, or follow it "
                                  "live (without --once)")
