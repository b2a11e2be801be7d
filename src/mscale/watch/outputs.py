"""Every output of one watch session, fed after each poll and closed once at the end.

After each poll: the view (live screen or plain lines), ``--jsonl`` lines for the new findings,
and the Prometheus textfile. At the end: the ``--json`` document and the ``--report`` page, so a
session stopped by Ctrl-C still leaves both. stdout carries machine output when ``--json`` or
``--jsonl`` is given, and then nothing else.

Every file written is named once on ``notes`` (stderr in the CLI, so it never mixes with the
machine output): ``wrote watch report: PATH``, ``wrote Prometheus textfile: PATH``. A file a
command writes without saying so is one a newcomer does not know to look for.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from typing import IO

from mscale.watch import report, sinks, timeline
from mscale.watch.findings import Finding
from mscale.watch.view import Actions, finished_line, make_view, running_line
from mscale.watch.window import Window


@dataclass
class OutputOptions:
    as_json: bool = False
    jsonl: bool = False
    prometheus: str | None = None
    report: str | None = None
    status_every_s: float = 30.0


class Outputs:
    """Implements `mscale.watch.follow.Outputs` for the CLI."""

    def __init__(self, options: OutputOptions, stream: IO[str] | None = None,
                 notes: IO[str] | None = None):
        self.options = options
        self.stream = stream or sys.stdout
        self._notes = notes
        self._follower = None
        self._prometheus_said = False
        self._logged = 0
        """Entries of the actor's log already put into words (`actions`)."""
        self.view = make_view(self.stream, options.as_json or options.jsonl,
                              lambda: self._follower.layout if self._follower else None,
                              options.status_every_s)

    def poll(self, follower, window: Window | None, new: list[Finding]) -> None:
        self._follower = follower
        if self.options.jsonl:
            sinks.write_jsonl(self.stream, new + list(getattr(follower, "rises", [])))
        acts = self.actions(follower, new)
        if follower.history is not None or new:  # a job may end before its first record
            self.view.update(follower.history, window, new, follower.open_findings(),
                             actions=acts)
        if self.options.prometheus:
            sinks.write_prometheus(self.options.prometheus, sinks.prometheus_text(
                follower.target.url, follower.history, follower.open_findings(),
                follower.findings, follower.feed.last_record_time, time.time()))
            if not self._prometheus_said:  # rewritten at every look: said once
                self._prometheus_said = True
                again = " (rewritten at each look)" if getattr(follower, "live", False) else ""
                self.note(f"wrote Prometheus textfile: {self.options.prometheus}{again}")

    def actions(self, follower, new: list[Finding]) -> Actions:
        """What the actor did since the last look, in words, each line under the new finding it
        was for (view.py); for a finding watch would act on but may not, the command that
        would."""
        actor = getattr(follower, "actor", None)
        log = list(getattr(actor, "log", []))
        fresh, self._logged = log[self._logged:], len(log)
        url = follower.target.url
        out = Actions()
        keys = {id(f): [f.kind, f.cause, list(f.ranks), list(f.nodes)] for f in new}
        for entry in fresh:
            text = action_text(entry, url)
            if text is None:
                continue
            f = next((f for f in new if keys[id(f)] == entry.get("finding_key")), None)
            if f is None:
                out.later.append(text)
            else:
                out.of.setdefault(id(f), []).append(text)
        acting = bool(getattr(actor, "acting", False))
        for f in new:
            if f.kind == "stop" or id(f) in out.of or not (f.hardware and f.nodes):
                continue
            layout = getattr(follower, "layout", None)
            out.of[id(f)] = [idle_text(f, url, acting, getattr(follower.target, "run", None),
                                       named=getattr(layout, "named", True))]
        return out

    def note(self, line: str) -> None:
        """One line about watch itself (what it wrote, what it waits for), never on stdout's
        machine output; the stream is looked up when used, so a redirected stderr is honoured."""
        out = self._notes or sys.stderr
        out.write(line + "\n")
        out.flush()

    def finish(self, follower) -> int:
        """Close the view, write the document and the report; return the exit code."""
        code = sinks.exit_code(follower.findings)
        if follower.history is not None or getattr(follower, "ended", None) is not None:
            # actions taken after the last look (a quarantine that waited for its checkpoint)
            self.view.update(follower.history, None, [], follower.open_findings(), final=True,
                             actions=self.actions(follower, []))
        self.view.close()
        line = self._last_word(follower, code)
        if line is not None:
            if self.options.jsonl:  # stdout holds findings only: a healthy job left no trace
                self.note(line)
            elif not self.options.as_json:  # the document's summary.job carries it
                self.stream.write(line + "\n")
                self.stream.flush()
        summary = follower.summary()
        if self.options.report:
            run = follower.target.run
            report.write_report(self.options.report, report.render(
                follower.target.url, follower.history, follower.layout, follower.findings,
                follower.actor.log, summary, code, timeline.latest(run.trace) if run else None,
                attempts=follower.attempts(), dropped=follower.attempts_dropped))
            self.note(f"wrote watch report: {self.options.report}")
        if self.options.as_json:
            doc = sinks.document(follower.target.url, follower.findings,
                                 follower.open_findings(), follower.actor.log, summary,
                                 follower.history, code)
            self.stream.write(json.dumps(doc, indent=2, default=str) + "\n")
            self.stream.flush()
        return code

    @staticmethod
    def _last_word(follower, code: int) -> str | None:
        """How the job stands as watch ends, unless its abnormal end already said it: finished,
        or still running (a run directory whose job holds its lock; a metrics file alone tells
        nothing of a job)."""
        end = getattr(follower, "job_end", None)
        if end is not None:
            return None if end.abnormal else finished_line(end, follower.open_findings(), code)
        job, watcher = getattr(follower, "job", None), getattr(follower, "watcher", None)
        if follower.target.run is None or job is None or watcher is None \
                or follower.history is None or not job.alive():
            return None
        attempt = ((job.started or {}).get("evidence") or {}).get("attempt")  # the newest
        return running_line(getattr(watcher, "last_step", None),
                            attempt if isinstance(attempt, int) else None,
                            follower.open_findings(), code)


def action_text(entry: dict, url: str) -> str | None:
    """One entry of the actor's log (watch/actions.py) in words; None for the events it
    records (every finding is one: saying so under each would be noise)."""
    what = entry.get("action")
    nodes = ", ".join((entry.get("finding_key") or [None] * 4)[3] or [])
    if what == "control/checkpoint":
        then = f"; {nodes} is quarantined once it is committed" if nodes else ""
        return f"checkpoint requested (control/checkpoint){then}"
    if what == "control/halt":
        return "halt requested (control/halt)"
    if what == "quarantine":
        added, already = entry.get("nodes") or [], entry.get("already") or []
        parts = []
        if added:
            how = entry.get("how") or ("after the requested checkpoint was committed"
                                       if entry.get("checkpoint_confirmed")
                                       else "without a confirmed checkpoint")
            parts.append(f"{', '.join(added)} quarantined {how} (quarantine.json)")
        if already:
            parts.append(f"{', '.join(already)} already quarantined")
        if entry.get("job_running"):  # a quarantine does not stop the job: say what does
            parts.append(f"the job runs on with it; to stop it now (a checkpoint is saved "
                         f"first): {halt_command(url)}")
        return "; ".join(parts) + (f"; to relaunch without it once the job has stopped: "
                                   f"mscale recover {shlex.quote(url)} --execute (or run the job "
                                   f"under mscale recover supervise, which does both)")
    return None


def idle_text(f: Finding, url: str, acting: bool, run, named: bool = True) -> str:
    """Under a hardware finding no action was taken for: why, and what would act on it.
    ``named``: the layout's node names are the cluster's (`JobLayout.named`)."""
    if not named:
        from mscale.watch.actions import UNNAMED_ACTION

        return UNNAMED_ACTION
    if run is None:
        return ("none: a metrics file alone has no run directory to act on (watch the run "
                "directory to checkpoint and quarantine)")
    if acting:
        return "none: an earlier watch already recorded it (events.jsonl)"
    return (f"none (--no-act): run mscale watch {shlex.quote(url)} without --no-act to "
            f"checkpoint and "
            f"quarantine {', '.join(f.nodes)}, or run the job under mscale recover supervise")


def halt_command(url: str) -> str:
    """How to ask the job of run ``url`` to stop (train's control/halt), as a command to paste
    into a shell: quoted, as every command watch prints. An object store has no ``touch``."""
    from mscale.runs.rundir import RunDir

    halt = RunDir(url).path("control", "halt")
    local = halt.removeprefix("file://")
    if "://" in local:
        return f"write an empty object at {halt}"
    return f"touch {shlex.quote(local)}"
