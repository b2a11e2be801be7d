"""A traced step read back: a per-stage summary for the report, and the step replayed from the
trace's own forward and backward times.

`train --trace-every N` writes ``RUN/trace/step-NNNNNN.json`` (train/trace.py: Chrome
trace-event format, one track per traced rank, named ``rank R · stage S · tp T · dp D``). The
report shows where a stage's time went (forward, backward, and each kind of wait), and checks
the what-if's replay (replay.py) against the real thing: the same schedule replayed with every
traced forward and backward at its measured duration, against the pipeline's measured span. The
replay has no transfer time, so it is a little shorter than the span; a large gap means the step
waited on something the schedule does not explain (a slow link, untraced host work).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path
from mscale.watch.replay import replay_actions, schedulable, step_graph

_TRACK = re.compile(r"rank (\d+) · stage (\d+) · tp (\d+) · dp (\d+)")
WAITS = ("bubble", "pp wait", "dp wait", "tp wait", "data", "comm_wait")


@dataclass
class Timeline:
    """One traced step: each traced rank's stage and its events (category, micro-batch, chunk,
    start s, end s); a forward's or backward's end is its start plus its busy time (`_net`)."""

    step: int
    stage: dict[int, int]
    events: dict[int, list[tuple[str, int, int, float, float]]]


def latest(trace_dir: str) -> str | None:
    """The newest ``step-NNNNNN.json`` in ``trace_dir``, or None."""
    fs, path = fs_and_path(trace_dir)
    if not fs.isdir(path):
        return None
    names = sorted(n for n in (p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
                   if re.fullmatch(r"step-\d+\.json", n))
    return f"{trace_dir.rstrip('/')}/{names[-1]}" if names else None


def load(url: str) -> Timeline:
    """Read a trace `train` wrote; a file that is not one is exit 3 naming it."""
    try:
        fs, path = fs_and_path(url)
        with fs.open(path, "rb") as f:
            doc = json.loads(f.read())
        stage, events = {}, {}
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                m = _TRACK.fullmatch(e["args"]["name"])
                if m:
                    stage[int(m.group(1))] = int(m.group(2))
            elif e.get("ph") == "X":
                a = e.get("args", {})
                t0 = e["ts"] / 1e6
                events.setdefault(int(e["tid"]), []).append(
                    (e["cat"], int(a.get("micro_batch", -1)), int(a.get("chunk", 0)), t0,
                     t0 + e["dur"] / 1e6))
        step = int(doc["otherData"]["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MscaleError(f"not a timeline written by mscale train ({exc})", file=url,
                          fix="give a RUN/trace/step-NNNNNN.json file") from None
    return Timeline(step, stage, {r: _net(v) for r, v in events.items() if r in stage})


def _net(events: list[tuple]) -> list[tuple]:
    """A rank's events with each forward and backward shortened by the waits inside it (a
    forward's span holds the receive of its input): what the replay needs is the time the rank
    itself was busy, the schedule supplies the waiting. Data loading is the rank's own work."""
    waits = [(t0, t1) for cat, _, _, t0, t1 in events if cat in WAITS and cat != "data"]
    out = []
    for cat, micro, chunk, t0, t1 in events:
        if cat in ("forward", "backward"):
            inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in waits)
            out.append((cat, micro, chunk, t0, t0 + max(0.0, t1 - t0 - inside)))
        else:
            out.append((cat, micro, chunk, t0, t1))
    return out


def stage_summary(tl: Timeline) -> list[dict]:
    """Per stage: traced ranks, seconds of forward, backward and each wait (the mean over the
    stage's traced ranks), and the span from the first to the last event."""
    out = []
    for s in sorted(set(tl.stage.values())):
        ranks = [r for r in tl.events if tl.stage[r] == s]
        per = {k: 0.0 for k in ("forward", "backward", *WAITS)}
        lo, hi = [], []
        for r in ranks:
            for cat, _, _, t0, t1 in tl.events[r]:
                if cat in per:
                    per[cat] += (t1 - t0) / len(ranks)
            lo.append(min(e[3] for e in tl.events[r]))
            hi.append(max(e[4] for e in tl.events[r]))
        out.append({"stage": s, "ranks": ranks, **per,
                    "span": (max(hi) - min(lo)) if ranks else 0.0})
    return out


def replayed(tl: Timeline, vpp: int = 1) -> tuple[float, float] | None:
    """(the measured span of the traced ranks' events, the schedule replayed with the traced
    forward and backward busy times), in seconds; None when the trace is not one whole pipeline (a stage
    without a traced rank, or missing actions)."""
    stages = sorted(set(tl.stage.values()))
    pp = len(stages)
    if pp < 2 or stages != list(range(pp)):
        return None
    took: dict[tuple[int, str, int, int], float] = {}
    first, last = [], []
    for r, evs in tl.events.items():
        for cat, micro, chunk, t0, t1 in evs:
            first.append(t0)
            last.append(t1)
            if cat in ("forward", "backward"):
                key = (tl.stage[r], "F" if cat == "forward" else "B", micro, chunk)
                took[key] = max(took.get(key, 0.0), t1 - t0)  # a TP group: its slowest
    m = len({k[2] for k in took})
    if not m or schedulable(pp, vpp, m) != m:
        return None
    graph = step_graph(pp, vpp, m)
    if any(k not in took for k in graph.keys):
        return None
    durations = np.array([took[k] for k in graph.keys])
    return max(last) - min(first), float(replay_actions(graph, durations))
