"""``watch --report FILE.html``: one self-contained page for CI artifacts and post-mortems.

The page must open years later on an air-gapped laptop: no script, no stylesheet or font from a
network, every figure inlined as SVG drawn by matplotlib (raster heat maps become base64 PNGs
inside the SVG). matplotlib is used through `Figure` directly, never pyplot, so no GUI backend
or global state is touched and the import happens only when a report is asked for.

What it shows: loss, gradient-norm and throughput curves; per-rank × step heat maps of compute
time and of communication wait with lines at node boundaries (a straggler is a bright compute
row and a dark wait row; its peers are the opposite), one pair per attempt, labelled by its
number and nodes (a re-plan changes both: the attempt before it is where the straggler was);
and every finding with its evidence and what watch did about it; and, when the run recorded a
timeline (`train --trace-every`), the newest traced step per stage, with the schedule replayed
from its own durations (watch/timeline.py).
"""

from __future__ import annotations

import html
import io
import json
import time

import numpy as np

from mscale.runs.atomic import write_text_atomic
from mscale.watch.actions import finding_dict
from mscale.watch.findings import Finding
from mscale.watch.history import AttemptHistory, History
from mscale.watch.layout import JobLayout

MAX_NODE_LINES = 128
"""Above this many nodes, boundaries are left out: the lines would cover the heat map."""

_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}.critical{color:#b00;font-weight:bold}
.warning{color:#b60}.info{color:#06b}pre{margin:0;font-size:12px;white-space:pre-wrap}
svg{max-width:100%;height:auto}"""


def _svg(fig) -> str:
    """A figure as an inline ``<svg>`` element (the XML prolog and doctype stripped)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _curves(attempts: list[AttemptHistory]) -> str:
    """The curves of every attempt kept, on one step axis (a relaunch resumes at its
    checkpoint's step, so its curve overlaps the end of the one before)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.5))
    axes = fig.subplots(3, 1, sharex=True)
    several = len(attempts) > 1
    for ax, (name, label) in zip(axes, (("loss", "loss"), ("grad_norm", "gradient norm"),
                                        ("tokens_per_s", "tokens/s"))):
        for a in attempts:
            steps, values = a.history.scalar(name)
            which = f"attempt {a.number}" if a.number is not None else "an attempt"
            ax.plot(steps, values, lw=1.2,
                    label=(which if several else "train") if name == "loss" else None)
            if name == "loss" and a.history.evals:
                at, held = zip(*a.history.evals)
                ax.plot(at, held, "o-", ms=3, lw=1,
                        label="held-out (eval)" + (f", {which}" if several else ""))
        if name == "loss" and (several or any(a.history.evals for a in attempts)):
            ax.legend(loc="upper right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return _svg(fig)


def _heat(history: History, layout: JobLayout | None, which: str, title: str) -> str:
    from matplotlib.figure import Figure

    steps, grid = history.heat(which)
    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    extent = (float(steps[0]) - 0.5, float(steps[-1]) + 0.5, grid.shape[0] - 0.5, -0.5)
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", extent=extent)
    fig.colorbar(im, ax=ax, label="seconds")
    if layout is not None and 1 < layout.world // layout.ranks_per_node <= MAX_NODE_LINES:
        for b in range(layout.ranks_per_node, layout.world, layout.ranks_per_node):
            ax.axhline(b - 0.5, color="cyan", lw=0.6)
        centres = np.arange(layout.world // layout.ranks_per_node) * layout.ranks_per_node
        ax.set_yticks(centres + (layout.ranks_per_node - 1) / 2,
                      labels=list(layout.node_names), fontsize=7)
        ax.set_ylabel("rank, by node")
    else:
        ax.set_ylabel("rank")
    ax.set_xlabel("step")
    ax.set_title(title)
    return _svg(fig)


def _table(rows: list[list[str]], head: list[str]) -> str:
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for row in rows:
        out += ["<tr>", *(f"<td>{cell}</td>" for cell in row), "</tr>"]
    return "".join(out + ["</table>"])


def _findings(findings: list[Finding]) -> str:
    if not findings:
        return "<p>No findings: the run looks healthy.</p>"
    rows = []
    for f in findings:
        d = finding_dict(f)
        steps = f"{f.first_step}–{f.last_step}" if f.last_step != f.first_step else f.first_step
        slow = "" if f.slowdown_pct is None else f"{f.slowdown_pct:+.1f}%"
        evidence = html.escape(json.dumps(d["evidence"], indent=1, default=str))
        rows.append([f'<span class="{f.severity}">{f.severity}</span>', html.escape(f.kind),
                     html.escape(f.cause), html.escape(_few(f.ranks)), html.escape(_few(f.nodes)),
                     html.escape(str(steps)), slow, html.escape(f.message),
                     html.escape(f.advice), f"<details><summary>evidence</summary>"
                                            f"<pre>{evidence}</pre></details>"])
    return _table(rows, ["severity", "kind", "cause", "ranks", "nodes", "steps", "what-if",
                         "message", "advice", "evidence"])


def _few(items, limit: int = 16) -> str:
    items = [str(i) for i in items]
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit})" if len(items) > limit else "")


def _timeline(trace_url: str, layout: JobLayout | None) -> str:
    """The newest traced step: a table per stage and the replay check (module docstring)."""
    from mscale.errors import MscaleError
    from mscale.watch import timeline

    try:
        tl = timeline.load(trace_url)
    except MscaleError as exc:  # the page still reports the run; it says why there is no timeline
        return f"<p>{html.escape(trace_url)}: {html.escape(str(exc))}</p>"
    rows = timeline.stage_summary(tl)
    cols = ("forward", "backward", *timeline.WAITS, "span")
    out = [f"<p>{html.escape(trace_url)} (step {tl.step}): open it in ui.perfetto.dev or "
           f"chrome://tracing, one track per rank. Seconds per traced rank, mean over the "
           f"stage's traced ranks:</p>",
           _table([[str(r["stage"]), _few(r["ranks"])] + [f"{r[c]:.4g}" for c in cols]
                   for r in rows], ["stage", "ranks", *cols])]
    check = timeline.replayed(tl, layout.vpp if layout is not None else 1)
    if check is not None:
        span, replay = check
        out.append(f"<p>The traced step's pipeline spans {span:.4g} s; the schedule replayed "
                   f"with its forwards' and backwards' measured busy times and no transfer "
                   f"time takes {replay:.4g} s ({100 * replay / span:.0f}%). The rest is "
                   f"transfers and waits the schedule does not explain (watch's what-if uses "
                   f"the same replay).</p>")
    return "".join(out)


def render(target: str, history: History | None, layout: JobLayout | None,
           findings: list[Finding], actions: list[dict], summary: dict, code: int,
           trace_url: str | None = None, attempts: list[AttemptHistory] | None = None,
           dropped: int = 0) -> str:
    """The whole page as one string. ``attempts``: every attempt kept, oldest first (default:
    ``history`` on ``layout`` alone); ``dropped``: earlier attempts no longer kept."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>mscale watch: "
             f"{html.escape(target)}</title><style>{_CSS}</style></head><body>",
             f"<h1>mscale watch</h1><p><b>{html.escape(target)}</b> — exit code {code} "
             f"({['healthy', 'warnings', 'critical'][min(code, 2)]}), written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}</p>"]
    if layout is not None:
        parts.append(f"<p>layout tp {layout.tp} × pp {layout.pp} × dp {layout.dp} = "
                     f"{layout.world} ranks on {len(layout.node_names)} node(s)</p>")
    parts.append("<h2>Summary</h2>" + _table(
        [[html.escape(str(k)), html.escape(json.dumps(v, default=str))]
         for k, v in summary.items()], ["", ""]))
    parts.append(f"<h2>Findings ({len(findings)})</h2>" + _findings(findings))
    if actions:
        parts.append("<h2>Actions</h2>" + _table(
            [[html.escape(time.strftime("%H:%M:%S", time.localtime(a.get("time", 0)))),
              html.escape(str(a.get("action"))),
              html.escape(json.dumps({k: v for k, v in a.items() if k not in ("time", "action")},
                                     default=str))] for a in actions], ["time", "action", ""]))
    if attempts is None:
        attempts = [AttemptHistory(None, history, layout)] if history is not None else []
    attempts = [a for a in attempts if a.history.scalars.used]
    if attempts:
        parts += ["<h2>Curves</h2>", _curves(attempts), "<h2>Per-rank time</h2>"]
        if dropped:
            parts.append(f"<p>{dropped} earlier attempt(s) not kept: watch keeps the newest "
                         f"{len(attempts)}.</p>")
        for a in attempts:  # a re-plan changes the ranks and nodes: one pair of maps each
            parts += [f"<h3>{html.escape(a.label())}</h3>" if len(attempts) > 1 or dropped
                      else "",
                      _heat(a.history, a.layout, "compute", "compute time per rank"),
                      _heat(a.history, a.layout, "wait", "communication wait per rank")]
    else:
        parts.append("<p>No metrics records yet.</p>")
    if trace_url:
        parts += ["<h2>Timeline</h2>", _timeline(trace_url, layout)]
    return "".join(parts) + "</body></html>\n"


def write_report(url: str, page: str) -> None:
    write_text_atomic(url, page)
