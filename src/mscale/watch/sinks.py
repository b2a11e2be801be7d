"""Where watch's conclusions go besides the screen: JSON, JSON lines, a Prometheus textfile.

- ``--json``: one document when watch ends (findings, actions, summary, exit code), for scripts.
- ``--jsonl``: one finding per line as it is found, flushed, for a pipe into a log shipper.
- ``--prometheus FILE``: node_exporter's textfile collector reads every ``*.prom`` file of its
  directory on each scrape; a half-written file would be scraped as garbage, so the exposition
  text (rendered by ``prometheus-client``) replaces the file atomically each time.

Per-rank series are not exported: 12,288 ranks × eight vectors would be 98,304 series per job,
more than most Prometheus servers accept from one target. The slowest ranks appear through the
open findings, each labelled with its ranks and nodes.
"""

from __future__ import annotations

import json
import math
import time
from typing import IO

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from mscale.runs.atomic import write_bytes_atomic
from mscale.watch.actions import finding_dict
from mscale.watch.findings import Finding
from mscale.watch.history import History

SEVERITY_CODE = {"info": 0, "warning": 1, "critical": 2}
"""A severity as watch's exit code: 0 healthy, 1 warnings, 2 critical."""

MAX_FINDING_SERIES = 64
"""Open findings exported one series each; more are counted but not labelled one by one."""


def exit_code(findings: list[Finding]) -> int:
    """The worst severity seen, as an exit code (an info finding leaves the run healthy)."""
    return max((SEVERITY_CODE.get(f.severity, 0) for f in findings), default=0)


def write_jsonl(stream: IO[str], findings: list[Finding]) -> None:
    """One finding per line, flushed so a reader of the pipe sees it at once."""
    for f in findings:
        stream.write(json.dumps(_finite(finding_dict(f)), default=str) + "\n")
    if findings:
        stream.flush()


def document(target: str, findings: list[Finding], open_findings: list[Finding],
             actions: list[dict], summary: dict, history: History | None, code: int) -> dict:
    """The ``--json`` document: everything watch concluded, with the exit code it chose."""
    return _finite({"target": target, "exit_code": code, "summary": summary,
                    "latest": history.latest if history else {},
                    "findings": [finding_dict(f) for f in findings],
                    "open": [finding_dict(f) for f in open_findings], "actions": actions})


def _finite(value):
    """JSON has no NaN: a NaN loss (exactly what a finding may be about) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def prometheus_text(run: str, history: History | None, open_findings: list[Finding],
                    emitted: list[Finding], last_record_time: float | None,
                    now: float | None = None) -> bytes:
    """The exposition text of one moment of the run (module docstring)."""
    reg = CollectorRegistry()

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"mscale_watch_{name}", doc, ("run", *labels), registry=reg)

    latest = history.latest if history else {}
    for key, name, doc in (("step", "step", "Newest step seen."),
                           ("loss", "loss", "Loss of the newest step."),
                           ("grad_norm", "grad_norm", "Gradient norm of the newest step."),
                           ("tokens_per_s", "tokens_per_second", "Throughput of the newest step."),
                           ("mfu", "mfu", "Model FLOPs utilisation of the newest step (0..1)."),
                           ("step_time", "step_time_seconds", "Median step time over ranks.")):
        value = latest.get(key)
        if value is not None and value == value:
            gauge(name, doc).labels(run).set(value)
    if last_record_time is not None:
        gauge("last_record_age_seconds", "Seconds since a record was last seen.").labels(
            run).set(max(0.0, (now or time.time()) - last_record_time))
    gauge("severity", "Worst open finding: 0 healthy, 1 warning, 2 critical.").labels(run).set(
        exit_code(open_findings))
    count = gauge("findings_open", "Open findings by kind, cause and severity.",
                  ("kind", "cause", "severity"))
    for f in open_findings:
        count.labels(run, f.kind, f.cause, f.severity).inc()
    total = gauge("findings_total", "Findings raised since watch started, by kind.", ("kind",))
    for f in emitted:
        total.labels(run, f.kind).inc()
    slow = gauge("finding_slowdown_percent", "What-if: how much slower the job is because of "
                 "this open finding.", ("kind", "cause", "ranks", "nodes"))
    for f in open_findings[:MAX_FINDING_SERIES]:
        if f.slowdown_pct is not None:
            slow.labels(run, f.kind, f.cause, _short(f.ranks), _short(f.nodes)).set(
                f.slowdown_pct)
    return generate_latest(reg)


def _short(items, limit: int = 8) -> str:
    items = [str(i) for i in items]
    more = f",+{len(items) - limit}" if len(items) > limit else ""
    return ",".join(items[:limit]) + more


def write_prometheus(url: str, text: bytes) -> None:
    """Replace the textfile atomically (a scrape never sees half of it)."""
    write_bytes_atomic(url, text)
