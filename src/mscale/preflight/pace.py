"""How a link measurement is paced: its sizes and passes, its probes, and when it is cut short.

Shared by the point-to-point pairs (`network.py`) and the collectives on each group
(`busbw.py`): every measurement starts with small probes and stops there when the link is
already far below what its peers so far reached (`Pace`, `timed_iterations`): a degraded NIC
costs its probes, not every full-size transfer of every pass. The ranks of a pair or group always
take the same decision. Each turn's figures are all-gathered (`share`): every rank keeps the same
`Pace`, and rank 0 reports progress (`preflight/progress.py`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mscale.preflight.compute import Slowdown

BYTES = {("cpu", "quick"): 4 << 20, ("cpu", "full"): 16 << 20, ("cuda", "quick"): 64 << 20,
         ("cuda", "full"): 512 << 20}
ITERS = {"quick": 10, "full": 30}
BUDGET_S = {"quick": 1.5, "full": 5.0}
"""Seconds a pair's or collective's timed iterations may take, judged from its probe: a link
sending at a tenth of its rate would otherwise hold the whole check (a re-check of a node with a
degraded NIC took over five minutes under SLURM); it is as slow in one trip as in thirty. With no
peer figure to compare with yet, it is also the deadline of one full-size transfer (`limit_s`)."""
MIN_ITERS = 1
PASSES = {"quick": 2, "full": 3}
"""Every pair and group is measured in this many passes over all of them, its best kept: a
burst of other load lasts a moment, so it spoils one pass of a link but not every pass, while
a slow device or link is slow in all of them. A link cut short (below) is not measured in the
later passes of its round: its probes, the faster of two, were both far below its peers, and
the second round (`recheck.py`) measures it again before anything is flagged."""
PROBE_DIV = 8
PROBES = 2
"""Each measurement starts with PROBES timed probes of 1/PROBE_DIV of its size, the faster kept
(after an untimed one of the same size that lines the ends up): one descheduled moment on a
shared core spoils one probe, a slow link every one."""
SLOW_FACTOR = 10.0
"""A probe projecting to more than SLOW_FACTOR x the expected time (under 10 % of the peers'
bandwidth, well below the 0.3-0.5 x that is CRITICAL) is cut short: its verdict cannot change."""
FLOOR_S = 0.25
"""...and only when its full-size transfer would take longer than this: a healthy link's takes
milliseconds, so one descheduled moment cannot cut a healthy link short."""


@dataclass
class Pace:
    """The figures of the links measured so far, the same on every rank (each turn's figures are
    all-gathered, `share`): what a new measurement is expected to reach. Kept across both
    rounds (the second measures only suspects, and compares them with the first round's peers).

    Keyed by (measure, whether the link stays inside one node): "p2p", or a collective's name
    (its algbw). A class with fewer than two figures has no expectation yet, and `limit_s` is
    the budget: it never borrows across the node boundary, where NVLink is ten times a NIC's
    share (held to NVLink's pace, every healthy cross-node link of a GPU cluster would be cut
    short and judged on its probe alone)."""

    seen: dict[tuple[str, bool], list[float]] = field(default_factory=dict)

    def add(self, measure: str, local: bool, gbps: float) -> None:
        if gbps == gbps and gbps > 0:  # not NaN
            self.seen.setdefault((measure, local), []).append(gbps)

    def expected(self, measure: str, local: bool) -> float | None:
        own = self.seen.get((measure, local), [])
        return statistics.median(own) if len(own) >= 2 else None

    def limit_s(self, measure: str, local: bool, work_bytes: int, level: str) -> float:
        """The deadline of one full-size transfer of ``work_bytes``: SLOW_FACTOR x the expected
        time (never under FLOOR_S); without an expectation, the level's whole budget."""
        ref = self.expected(measure, local)
        if ref is None:
            return BUDGET_S.get(level, float("inf"))
        return max(FLOOR_S, SLOW_FACTOR * work_bytes / (ref * 1e9))


def iterations(full_s: float, level: str) -> int:
    """Timed iterations of a transfer that takes about ``full_s``: `ITERS`, fewer when they
    would not fit `BUDGET_S`, never fewer than `MIN_ITERS`."""
    budget = BUDGET_S.get(level)
    fit = ITERS[level] if budget is None else int(budget / max(full_s, 1e-9))
    return max(MIN_ITERS, min(ITERS[level], fit))


def timed_iterations(probe_s: float, scale: float, limit_s: float, level: str) -> int:
    """From a probe of 1/``scale`` of the size that took ``probe_s``: 0 (cut short: the full
    transfer would pass ``limit_s`` and `FLOOR_S`, so the verdict cannot change), else how many
    full-size iterations to time."""
    projected = probe_s * scale
    if projected > max(limit_s, FLOOR_S):
        return 0
    return iterations(projected, level)


def probe_numel(numel: int, n: int = 1) -> int:
    """Elements of a probe of a ``numel``-element transfer (`PROBE_DIV`), a multiple of ``n``."""
    return max(n, numel // PROBE_DIV // n * n)


def best_of(fn, count: int, slow: Slowdown, label: str, line_up=lambda: None) -> float:
    """The best of ``count`` timed calls of ``fn`` (which waits for its device), each after
    ``line_up`` (a group's barrier: the time is then the transfer, not a member's late start)."""
    best = float("inf")
    for _ in range(count):
        line_up()
        t0 = time.perf_counter()
        fn()
        slow.after(t0, label)
        best = min(best, time.perf_counter() - t0)
    return best


def share(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (as many on every rank), on every rank: a turn's figures, so
    that each rank updates the same `Pace` and rank 0 can report progress. A collective on the
    whole job: it also ends the turn, as a barrier would."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    return [g.tolist() for g in got]


def keep_best(best: dict[tuple, dict], items: list[dict], key: str, higher: bool) -> None:
    """Per item (same kind, op, ranks) keep the best ``key`` over the passes."""
    for it in items:
        k = (it["kind"], it.get("op"), tuple(it["ranks"]))
        if k not in best or (it[key] > best[k][key]) == higher:
            best[k] = it


def on_nodes(ranks: list[int], nodes: list[str] | None) -> str:
    """Where ``ranks`` run, for a progress line (" on node1<->node2"); nothing without
    ``nodes``."""
    if not nodes:
        return ""
    return " on " + "<->".join(dict.fromkeys(nodes[r] for r in ranks))
