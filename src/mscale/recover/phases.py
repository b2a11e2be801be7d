"""How long each phase of one recovery took, measured from the run directory's own records.

A recovery is timed in four phases, each a ``recover`` event (source ``recover``) in
``events.jsonl`` with ``evidence.phase`` and ``evidence.seconds``, then one ``total``:

- ``detect``: from the failure to the moment supervise knows. The failure's time is the earliest
  record of it the run holds (a rank's error file, the launcher's ``stop``/``hang`` event, a new
  quarantine entry), else the moment the job's exit was seen; a hang's own start is unknowable
  from outside, so the seconds since the last completed step are recorded beside it
  (``since_last_step_s``), which bound the real detection latency from above;
- ``diagnose``: diagnosis, checkpoint choice, exclusions, re-plan, and applying the plan;
- ``restart``: from the relaunch (after the back-off) to the new attempt's ``start`` event;
- ``catch_up``: from that ``start`` to the first step past the one that failed, i.e. until the
  run has regained what it lost (zero steps lost: its first new step);
- ``total``: failure to catch-up, back-off included (``backoff_s`` says how much of it).

MegaScale measures its own recovery the same way, from detection to training again, and the
effective-training-time model of ``recover.simulate`` takes these phase times as inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from mscale.config.records import Event
from mscale.errors import MscaleError
from mscale.recover.diagnose.read import JSONL_TAIL_BYTES, read_jsonl_tail
from mscale.runs.rundir import RunDir
from mscale.train.failure import read_error_files
from mscale.watch.stream import MetricsFeed

PHASES = ("detect", "diagnose", "restart", "catch_up")
"""The timed phases, in order; ``total`` follows them."""
FAILURE_KINDS = ("stop", "hang", "nan", "checkpoint_failed")
"""train events whose time can mark a failure (a ``stop`` only when its code is not 0)."""


def failure_time(run: RunDir, since: float, seen_at: float) -> tuple[float, str]:
    """The earliest record of the failure written after ``since`` (the attempt's launch), and
    what it was; ``seen_at`` when the run holds none (the job died without a word)."""
    found: list[tuple[float, str]] = []
    for rank, err in read_error_files(run).items():
        t = err.get("time")
        if isinstance(t, (int, float)) and t >= since:
            found.append((float(t), f"logs/rank{rank}.error.json"))
    for ev in read_events(run):
        t = ev.get("time")
        if (ev.get("source", "train") == "train" and ev.get("kind") in FAILURE_KINDS
                and isinstance(t, (int, float)) and t >= since
                and not (ev["kind"] == "stop" and ev.get("evidence", {}).get("code") == 0)):
            found.append((float(t), f"events.jsonl: {ev['kind']}"))
    return min(found) if found else (seen_at, "the job's exit")


def read_events(run: RunDir) -> list[dict]:
    """The run's recent events, as the diagnosis reads them: the file's tail, a bad line skipped
    (a whole-file read of a damaged file gave none, and supervise took a halt for a failure or
    a started job for one that never started); none when it cannot be read. Every caller looks
    back from the end to the attempt's launch, which the tail holds."""
    try:
        events, _ = read_jsonl_tail(run.events, JSONL_TAIL_BYTES)
    except (OSError, ValueError, MscaleError):  # unreadable costs only a timestamp
        return []
    return [e for e in events if isinstance(e, dict)]


@dataclass
class Recovery:
    """The clock of one recovery, from its failure to the step that regains it."""

    run: RunDir
    number: int
    """1 for the first recovery supervise makes, 2 for the next, ..."""
    failed_at: float
    """Wall time of the failure (`failure_time`)."""
    failure_source: str
    """Which record dated it."""
    known_at: float
    """When supervise knew."""
    failed_step: int | None = None
    """Last step completed before the failure; catch-up ends when a later step is recorded."""
    last_step_at: float | None = None
    """Wall time of the last metrics record before the failure (bounds a hang's detection)."""
    marks: dict[str, float] = field(default_factory=dict)
    """Phase boundaries: ``diagnosed``, ``relaunched``, ``started``, ``caught_up``."""
    backoff_s: float = 0.0
    attempt: int | None = None
    """Attempt number of the relaunched job, once its ``start`` event is seen."""
    written: list[str] = field(default_factory=list)
    """Phases whose event is already in events.jsonl."""

    @property
    def done(self) -> bool:
        return "total" in self.written

    def seconds(self, phase: str) -> float | None:
        m = self.marks
        spans = {"detect": (self.failed_at, self.known_at),
                 "diagnose": (self.known_at, m.get("diagnosed")),
                 "restart": (m.get("relaunched"), m.get("started")),
                 "catch_up": (m.get("started"), m.get("caught_up")),
                 "total": (self.failed_at, m.get("caught_up"))}
        a, b = spans[phase]
        return None if a is None or b is None else max(0.0, b - a)

    def summary(self) -> dict:
        """Every phase's seconds (None: not reached), for the supervise state file and tests."""
        return {p: self.seconds(p) for p in (*PHASES, "total")} | {
            "backoff_s": self.backoff_s, "failed_step": self.failed_step,
            "failure_source": self.failure_source}


class PhaseLog:
    """Writes each phase's event as soon as it ends, and watches the relaunched job for the
    ``start`` and the first step past the failure (``poll``)."""

    def __init__(self, run: RunDir, clock: Callable[[], float] = time.time):
        self.run, self.clock = run, clock
        self.current: Recovery | None = None
        self.history: list[Recovery] = []
        self._feed: MetricsFeed | None = None
        self._last_step: int | None = None
        self._last_step_at: float | None = None

    def watch_attempt(self) -> None:
        """Call before (re)launching: what the metrics file holds now belongs to earlier
        attempts, so only later records count as this attempt's steps."""
        self._feed = MetricsFeed(self.run.metrics, clock=self.clock)
        while True:
            self._note(self._feed.poll())
            if self._feed.caught_up:
                break

    def _note(self, records: list[dict]) -> list[dict]:
        if records:
            self._last_step = records[-1].get("step")
            t = records[-1].get("time")
            self._last_step_at = float(t) if isinstance(t, (int, float)) else self.clock()
        return records

    def failed(self, launched_at: float, failed_step: int | None = None,
               at: tuple[float, str] | None = None, known_at: float | None = None) -> Recovery:
        """The job stopped: open recovery number n, dated from the run's records, or ``at``
        (time, what) when supervise itself saw the failure first (a node quarantined while the
        job ran: the job's stop, which supervise asked for, is no failure)."""
        self.poll()
        now = self.clock() if known_at is None else known_at
        t, source = at or failure_time(self.run, launched_at, now)
        rec = Recovery(self.run, len(self.history) + 1, min(t, now), source, now,
                       failed_step=failed_step if failed_step is not None else self._last_step,
                       last_step_at=self._last_step_at)
        self.current = rec
        self.history.append(rec)
        self._emit(rec, "detect", {"since_last_step_s": None if rec.last_step_at is None
                                   else round(now - rec.last_step_at, 3)})
        return rec

    def mark(self, name: str, extra: dict | None = None) -> None:
        """A boundary supervise itself passes: ``diagnosed`` (with the plan's gist in
        ``extra``) or ``relaunched``."""
        rec = self.current
        if rec is None:
            return
        rec.marks[name] = self.clock()
        if name == "diagnosed":
            self._emit(rec, "diagnose", extra or {})
        if name == "relaunched":
            self.watch_attempt()

    def poll(self) -> None:
        """Read what the relaunched attempt wrote; close the restart and catch-up phases."""
        rec = self.current
        # Steps first, then the start: train writes its start event before any step, so a
        # step read here has its start in the events read next. The other order lets steps
        # written between the two reads go by before the start is known, and the catch-up
        # would end at a later step than the first one past the failure.
        records = self._note(self._feed.poll()) if self._feed is not None else []
        if rec is not None and "relaunched" in rec.marks and "started" not in rec.marks:
            for ev in read_events(self.run):
                t = ev.get("time")
                if (ev.get("kind") == "start" and ev.get("source", "train") == "train"
                        and isinstance(t, (int, float)) and t >= rec.marks["relaunched"]):
                    rec.marks["started"] = float(t)
                    rec.attempt = ev.get("evidence", {}).get("attempt")
                    self._emit(rec, "restart", {})
                    break
        for r in records:
            if rec is None or "started" not in rec.marks or "caught_up" in rec.marks:
                continue
            if rec.failed_step is None or r.get("step", 0) > rec.failed_step:
                t = r.get("time")
                rec.marks["caught_up"] = float(t) if isinstance(t, (int, float)) else self.clock()
                self._emit(rec, "catch_up", {"step": r.get("step")})
                self._emit(rec, "total", {"backoff_s": round(rec.backoff_s, 3)})

    def _emit(self, rec: Recovery, phase: str, extra: dict) -> None:
        seconds = rec.seconds(phase)
        ends = {"detect": rec.known_at, "diagnose": rec.marks.get("diagnosed"),
                "restart": rec.marks.get("started"), "catch_up": rec.marks.get("caught_up"),
                "total": rec.marks.get("caught_up")}
        evidence = {"phase": phase, "seconds": None if seconds is None else round(seconds, 3),
                    "ended_at": ends[phase], "failed_at": rec.failed_at,
                    "recovery": rec.number, "failed_step": rec.failed_step,
                    "failure_source": rec.failure_source, **extra}
        if rec.attempt is not None:
            evidence["attempt"] = rec.attempt
        text = "?" if seconds is None else f"{seconds:.2f} s"
        self.run.append_record(self.run.events, Event(
            source="recover", kind="recover", step=rec.failed_step,
            message=f"recovery {rec.number}: {phase.replace('_', '-')} took {text}",
            evidence=evidence))
        rec.written.append(phase)
