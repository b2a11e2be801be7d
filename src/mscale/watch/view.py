"""What a person watching sees: a live rich view on a terminal, plain lines elsewhere.

On a terminal: the step, loss and gradient-norm trend, tokens/s and MFU, the slowest ranks and
nodes as a small heat map over the last steps (each cell: how far the rank's compute time is
above the median of all ranks at that step), and the open alerts. In a pipe, a log or CI, a
redrawn screen is noise, so the same facts come as plain lines: one per new finding, and a
status line every ``status_every_s`` seconds.

Under each new finding, indented, what to do and what watch did: ``  advice: …`` (the finding's
advice, once), then one ``  action: …`` line per action taken for it (``checkpoint requested
(control/checkpoint)``) or, when watch may not act, the command that would. An action taken
later (a quarantine once the requested checkpoint is committed) is its own ``action: …`` line
when it happens, and an open finding whose severity rises (a slow link whose measured cost
passes ``critical_slowdown_pct``) is said once more, as ``escalated to CRITICAL: …``.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mscale.watch.findings import Finding
from mscale.watch.history import History
from mscale.watch.layout import JobLayout
from mscale.watch.window import Window

SPARK = "▁▂▃▄▅▆▇█"
HEAT_STEPS = 40
"""Columns of the terminal heat map: the last steps, one each."""
HEAT_ROWS = 8
"""Ranks (and nodes) shown: the slowest by compute above the median."""
_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def sparkline(values: np.ndarray, width: int = 40) -> str:
    v = np.asarray(values, float)[-width:]
    v = v[np.isfinite(v)]
    if not len(v):
        return ""
    lo, hi = v.min(), v.max()
    idx = np.zeros(len(v), int) if hi == lo else ((v - lo) / (hi - lo) * (len(SPARK) - 1))
    return "".join(SPARK[int(i)] for i in np.round(idx))


def finding_line(f: Finding) -> str:
    """One plain line per finding (also the live view's alert rows). The job's own end is about
    the job, not a rank or a step: ``CRITICAL job stopped: rank 5 on node3 killed by SIGKILL
    (exit 3)``."""
    if f.kind == "stop":
        return f"{f.severity.upper()} {f.message}"
    where = ""
    if f.ranks:
        where += f" rank{'s' if len(f.ranks) > 1 else ''} {_few(f.ranks)}"
    if f.nodes:
        where += f" ({_few(f.nodes)})"
    slow = "" if f.slowdown_pct is None else f" {f.slowdown_pct:+.1f}%"
    steps = "" if f.first_step is None else f"step {f.first_step} "
    return f"{steps}{f.severity.upper()} {f.kind}/{f.cause}{where}{slow}: {f.message}"


def finished_line(end, open_findings: list[Finding], code: int) -> str:
    """The last word on a job that finished cleanly (an abnormal end's is its own ``stop``
    finding): without it a finished run's watch ended on a status line that never said the job
    was over. ``OK job finished at step 30 (attempt 2, exit 0); no open alerts``: the label is
    watch's verdict, which open alerts from the steps before may raise, or a finding of the
    session already resolved (a slow node recovered from): then the line says so, since "CRITICAL
    job finished ...; no open alerts" alone read as a failure of the finished job."""
    label, alerts = _verdict(open_findings, code)
    at = "" if end.step is None else f" at step {end.step}"
    of = [f"attempt {end.attempt}"] if end.attempt is not None else []
    of += [] if end.exit_code is None else [f"exit {end.exit_code}"]
    detail = f" ({', '.join(of)})" if of else ""
    return f"{label} job finished{at}{detail}; {alerts}"


def running_line(step: int | None, attempt: int | None, open_findings: list[Finding],
                 code: int) -> str:
    """The last word on a job still running when watch ends (``--once`` mid-run, Ctrl-C):
    ``OK job still running at step 34 (attempt 1); no open alerts``. Without it the output
    ended on a status line as a finished job's once had, and a CI step could not tell a job
    still training from one that had finished."""
    label, alerts = _verdict(open_findings, code)
    at = "" if step is None else f" at step {step}"
    detail = "" if attempt is None else f" (attempt {attempt})"
    return f"{label} job still running{at}{detail}; {alerts}"


def _verdict(open_findings: list[Finding], code: int) -> tuple[str, str]:
    """Watch's verdict as a label, and the alerts still open (`finished_line`)."""
    label = {0: "OK", 1: "WARNING"}.get(code, "CRITICAL")
    kinds = sorted({f.kind for f in open_findings})
    alerts = (f"{len(open_findings)} open alert{'s' if len(open_findings) > 1 else ''} "
              f"({_few(kinds)})" if open_findings else "no open alerts")
    if code and not open_findings:
        alerts += f" (exit {code}: a {label.lower()} finding earlier in the session)"
    return label, alerts


_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass
class Actions:
    """What watch did since the view's last update, in words (outputs.py builds it from the
    actor's log): lines for a finding new in this update, by the finding's identity, and lines
    for findings said before (a quarantine that followed its checkpoint)."""

    of: dict[int, list[str]] = field(default_factory=dict)
    later: list[str] = field(default_factory=list)


def under(f: Finding, actions: Actions) -> list[str]:
    """The indented lines under a new finding: its advice, then what was done about it."""
    lines = [f"advice: {f.advice}"] if f.advice else []
    return lines + [f"action: {a}" for a in actions.of.get(id(f), [])]


def _few(items, limit: int = 6) -> str:
    items = [str(i) for i in items]
    return ",".join(items[:limit]) + (f",+{len(items) - limit}" if len(items) > limit else "")


def status_line(history: History | None, open_count: int) -> str:
    x = history.latest if history is not None else {}
    if not x:
        return "no metrics records yet"
    parts = [f"step {x['step']}", f"loss {x['loss']:.4g}", f"grad-norm {x['grad_norm']:.3g}",
             f"step-time {x['step_time']:.3g}s"]
    if np.isfinite(x.get("eval_loss", np.nan)):
        parts.insert(2, f"eval-loss {x['eval_loss']:.4g}")
    if np.isfinite(x.get("tokens_per_s", np.nan)):
        parts.append(f"tokens/s {_rate(x['tokens_per_s'])}")
    if np.isfinite(x.get("mfu", np.nan)):
        parts.append(f"MFU {100 * x['mfu']:.1f}%")
    return " | ".join(parts + [f"open alerts {open_count}"])


def _rate(v: float) -> str:
    """``613,900`` as train's console prints it, not ``6.139e+05``; a small rate keeps its
    digits (``3.25``)."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


class PlainView:
    """Lines for logs and pipes (module docstring)."""

    def __init__(self, stream: IO[str], status_every_s: float = 30.0, clock=time.monotonic):
        self.stream, self.every, self.clock = stream, status_every_s, clock
        self._last = self._step = None
        self._said: dict[int, tuple[Finding, str]] = {}
        """Each finding printed (by identity) and the severity it was printed with."""

    def update(self, history: History | None, window: Window | None, new: list[Finding],
               open_findings: list[Finding], final: bool = False,
               actions: "Actions | None" = None) -> None:
        """``history`` is None when a job ended before its first record (its end is the one
        finding there is). The job's end (a ``stop`` finding) is the last word: the status line
        of the steps before it comes first. ``actions``: what watch did since the last update
        (module docstring)."""
        actions = actions or Actions()
        ends = [f for f in new if f.kind == "stop"]
        for f in open_findings:
            said = self._said.get(id(f))
            if said is not None and said[0] is f and _RANK[f.severity] > _RANK[said[1]]:
                self.stream.write(f"escalated to {f.severity.upper()} at step {f.last_step}: "
                                  f"{finding_line(f)}\n")
                self._said[id(f)] = (f, f.severity)
        for f in new:
            if f.kind != "stop":
                self.stream.write(finding_line(f) + "\n")
                for line in under(f, actions):
                    self.stream.write(f"  {line}\n")
                self._said[id(f)] = (f, f.severity)
        for line in actions.later:
            self.stream.write(f"action: {line}\n")
        latest = history.latest if history is not None else {}
        now, step = self.clock(), latest.get("step")
        due = self._last is None or now - self._last >= self.every
        if latest and (step != self._step if final or ends else due):
            self.stream.write(status_line(history, len(open_findings)) + "\n")
            self._last, self._step = now, step
        for f in ends:
            self.stream.write(finding_line(f) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class LiveView:
    """The rich screen on a terminal, redrawn at each poll."""

    def __init__(self, layout_of, stream: IO[str] = sys.stdout):
        self.console = Console(file=stream)
        self.layout_of = layout_of
        """A callable returning the current `JobLayout` (None until known)."""
        self.recent: deque[np.ndarray] = deque(maxlen=HEAT_STEPS)
        self.done: deque[str] = deque(maxlen=5)
        """The last actions taken, newest last."""
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.live.start()

    def update(self, history: History | None, window: Window | None, new: list[Finding],
               open_findings: list[Finding], final: bool = False,
               actions: Actions | None = None) -> None:
        if actions is not None:
            for f in new:
                self.done.extend(actions.of.get(id(f), []))
            self.done.extend(actions.later)
        if window is not None and len(window):
            compute = window.per_rank("compute_time")
            for row in compute[-HEAT_STEPS:]:
                self.recent.append(row - np.median(row))
        self.live.update(self._render(history, open_findings), refresh=True)

    def _render(self, history: History | None, open_findings: list[Finding]):
        parts = [Text(status_line(history, len(open_findings)), style="bold")]
        steps, loss = history.scalar("loss") if history is not None else ((), ())
        _, gnorm = history.scalar("grad_norm") if history is not None else ((), ())
        if len(steps):
            parts += [Text(f"loss      {sparkline(loss)}"), Text(f"grad-norm {sparkline(gnorm)}")]
        if self.recent:
            parts.append(self._heat(np.stack(self.recent), self.layout_of()))
        alerts = Table(title="open alerts", show_header=False, box=None)
        for f in open_findings[:10]:
            alerts.add_row(Text(finding_line(f), style=_STYLE.get(f.severity, "")))
            if f.advice:
                alerts.add_row(Text(f"  advice: {f.advice}", style="dim"))
        if not open_findings:
            alerts.add_row(Text("none", style="green"))
        if not self.done:
            return Group(*parts, alerts)
        done = Table(title="actions taken", show_header=False, box=None)
        for line in self.done:
            done.add_row(Text(f"action: {line}"))
        return Group(*parts, alerts, done)

    def _heat(self, excess: np.ndarray, layout: JobLayout | None) -> Table:
        """Rows: the slowest ranks, then the slowest nodes; cells: compute above the median."""
        table = Table(title="compute above the median, last steps", show_header=False, box=None)
        mean = excess.mean(axis=0)
        top = np.argsort(mean)[::-1][:HEAT_ROWS]
        scale = max(float(excess.max()), 1e-9)
        for r in top:
            name = f"rank {r}" + (f" {layout.node_name(int(r))}" if layout else "")
            table.add_row(name, _cells(excess[:, r], scale))
        if layout is not None and layout.world // layout.ranks_per_node > 1:
            nodes = excess.reshape(len(excess), -1, layout.ranks_per_node).mean(axis=2)
            for n in np.argsort(nodes.mean(axis=0))[::-1][: min(3, nodes.shape[1])]:
                table.add_row(f"node {layout.node_names[int(n)]}", _cells(nodes[:, n], scale))
        return table

    def close(self) -> None:
        self.live.stop()


def _cells(values: np.ndarray, scale: float) -> Text:
    text = Text()
    for v in values:
        level = int(np.clip(v / scale, 0, 1) * 4)
        text.append("█", style=("grey23", "green", "yellow", "dark_orange", "red")[level])
    return text


class NullView:
    """``--json``/``--jsonl``: stdout carries the machine output, nothing else."""

    def update(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def make_view(stream: IO[str], quiet: bool, layout_of, status_every_s: float = 30.0):
    if quiet:
        return NullView()
    if stream.isatty():
        return LiveView(layout_of, stream)
    return PlainView(stream, status_every_s)
