"""Whether the job writing a run is alive, and how its newest attempt ended when it left no word.

The job is alive while ``lock.json`` is held by a live holder (runs/lock.py) and no ``stop``
follows its latest ``start``. A metrics file alone has neither; it counts as alive while watch
follows it live (hangs are judged), never with ``--once``.

A job can also end without recording it: the whole job SIGKILLed (launcher and ranks), the node
rebooted, rank 0 killed under torchrun or srun. Its newest ``start`` then has no ``stop``, and
the lock says the rest (`JobState.observe_death`): its holder's pid is gone (only checked on the
host the lock names, ``lock.json``'s ``host``: a SLURM job's rank 0 runs elsewhere), its heartbeat
is older than its lease (any host: the heartbeat is a thread, so a slow step does not stop it),
or ``lock.json`` is gone altogether (removed by hand after the job died: `train` holds it from
before its ``start`` until after its ``stop``). Watch read all three as a healthy run, exit 0.
"""

from __future__ import annotations

import time
from typing import Callable

from mscale.errors import MscaleError
from mscale.runs.lock import RunLock, stale_reason
from mscale.runs.rundir import RunDir
from mscale.watch import ending
from mscale.watch.ending import JobEnd

LIFECYCLE = ("start", "stop", "hang")
"""Events of ``train`` that open (start) or close (stop, hang) a job's life."""


class JobState:
    """Whether the job writing the run is alive (module docstring)."""

    def __init__(self, run: RunDir | None, follows_live: bool, clock: Callable[[], float]):
        self.run, self.clock = run, clock
        self.follows_live = follows_live
        self.last: str | None = None
        """The latest lifecycle event kind of ``train``."""
        self.event: dict | None = None
        """That event itself: a stop's severity, exit code and reason say how the job ended."""
        self.started: dict | None = None
        """The latest ``start`` (the attempt's number and run id)."""
        self.starts: list[dict] = []
        """Every ``start`` seen, oldest first: which attempt a record belongs to (the report)."""
        self.death: dict | None = None
        """A stop watch infers at this poll (`observe_death`), None while none is."""
        self.event_of_death: dict | None = None
        """The last death seen, kept so that the same one is one event across polls."""
        self._lock = RunLock(run.root, "watch") if run is not None else None

    def observe(self, events: list[dict]) -> None:
        for ev in events:
            if ev.get("source", "train") == "train" and ev.get("kind") in LIFECYCLE:
                self.last, self.event = ev["kind"], ev
                if ev["kind"] == "start":
                    self.started = ev
                    self.starts.append(ev)

    @property
    def stopped(self) -> bool:
        return self.last in ("stop", "hang") or self.death is not None

    @property
    def end_event(self) -> dict | None:
        """The event that ended the newest attempt: its own, or a death `observe_death` saw."""
        if self.last in ("stop", "hang"):
            return self.event
        return self.death

    def end(self) -> JobEnd | None:
        """How the newest attempt ended; None while it runs (or before any lifecycle event)."""
        return ending.job_end(self.end_event, self.started) if self.stopped else None

    def observe_death(self) -> None:
        """Judge, at every poll, whether a job is gone without a recorded end (module
        docstring): the attempt started, no ``stop`` or ``hang`` followed, and its lock's holder
        is dead, past its lease, or the lock is gone. Withdrawn when the holder looks alive
        again (a heartbeat late past its lease, then back). The caller reads the events again
        after this look at the lock (`Follower`): a job writes its stop, then lets the lock go,
        and a stop written between the two reads is no death."""
        self.death = None
        if self._lock is None or self.started is None or self.last != "start":
            return
        try:
            rec = self._lock.holder()
        except MscaleError:
            return
        run_id = (self.started.get("evidence") or {}).get("run_id")
        if rec is None:
            why, holder = f"no job holds the run directory ({self.run.lock} is gone)", None
        else:
            stale = stale_reason(rec, self.clock())
            if stale is None or (run_id and rec.run_id != run_id):
                return
            why = f"its lock's holder ({rec.host}, pid {rec.pid}) is gone: {stale}"
            holder = [rec.host, rec.pid, rec.run_id]
        seen = self.event_of_death
        if seen is not None and seen["evidence"]["holder"] == holder \
                and seen["evidence"]["started"] == self.started.get("time"):
            self.death = seen  # the same death: the same event, judged once
            return
        self.death = self.event_of_death = {
            "kind": "stop", "source": "watch", "severity": "critical", "time": self.clock(),
            "message": f"the job ended without recording its end: {why}",
            "evidence": {"reason": "died", "run_id": rec.run_id if rec else run_id,
                         "holder": holder, "why": why, "started": self.started.get("time")}}

    def date_death(self, last_step: int | None, last_record_time: float | None) -> None:
        """Say in a new death's line which attempt ended, after which step and since when, once
        every record before it is read (the metrics are read after the lock): an operator
        reading a cron check's line needs to know how much the job got done and how long it
        has been gone."""
        death = self.death
        if death is None or "step" in death:
            return
        started = self.started or {}
        attempt = (started.get("evidence") or {}).get("attempt")
        who = f"attempt {attempt}" if isinstance(attempt, int) else "the newest attempt"
        begun = started.get("time") if isinstance(started.get("time"), (int, float)) else None
        now = self.clock()
        if last_step is None or last_record_time is None or (begun or 0) > last_record_time:
            step, when = None, "before its first step" + (
                f" (started {_utc(begun)}, {_ago(now - begun)} ago)" if begun else "")
        else:
            step, when = last_step, (f"after step {last_step} (its last record "
                                     f"{_utc(last_record_time)}, "
                                     f"{_ago(now - last_record_time)} ago)")
        death["step"] = step
        death["message"] = (f"{who} ended without recording its end {when}: "
                            f"{death['evidence']['why']}")
        death["evidence"].update(attempt=attempt, last_step=step,
                                 last_record_time=last_record_time)

    def alive(self) -> bool:
        if self._lock is None:
            return self.follows_live
        if self.stopped:
            return False
        try:
            rec = self._lock.holder()
        except MscaleError:  # a torn or foreign lock file: say nothing about the job
            return False
        return rec is not None and stale_reason(rec, self.clock()) is None


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _ago(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``: how long ago, as a person reads it."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
