"""Point-to-point bandwidth on the pairs the plan's groups connect, and bus bandwidth per group.

Pairs: consecutive members of each TP and DP group (the ring neighbours a ring collective
uses; both ends of a 2-member group) and consecutive pipeline stages of each PP group (the
activations' path). On GPUs they are measured in rounds in which no rank is in two pairs, so a
pair's figure is its own link's; on CPUs one pair (and one group) at a time, since there every
"link" shares the same cores and concurrent tests would measure each other. Both ends of a pair
report their best round trip; the pair's figure is the slower end's. Collectives: all-reduce, all-gather, reduce-scatter on this rank's
TP, PP and DP groups as built by `mscale.distributed.groups.build_groups`, the code train uses.
Bandwidths follow nccl-tests (docs/references.md): algbw = S / t; busbw = algbw × 2(n−1)/n for
all-reduce and × (n−1)/n for all-gather and reduce-scatter, S the largest buffer (the full
output of an all-gather, the full input of a reduce-scatter).

A test starts with small probes and stops there when the link is already far below what its
peers so far reached (`Pace`, `timed_iterations`): a degraded NIC costs its probes, not every
full-size transfer of every pass. The ranks of a pair or group always take the same decision.
Each turn's figures are all-gathered (`_share`): every rank keeps the same `Pace`, and rank 0
reports progress (`preflight/progress.py`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mscale.distributed.collectives import all_gather_into, reduce_scatter_into
from mscale.distributed.groups import ParallelGroups
from mscale.preflight.compute import Slowdown, sync
from mscale.preflight.progress import LinkProgress
from mscale.topology.placement import Placement

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
KINDS = ("tp", "pp", "dp")
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")


def _chain(group: list[int], ring: bool) -> list[tuple[int, int]]:
    if len(group) < 2:
        return []
    pairs = list(zip(group, group[1:]))
    if ring and len(group) > 2:
        pairs.append((group[-1], group[0]))
    return pairs


def plan_pairs(placement: Placement) -> list[tuple[str, int, int]]:
    """Every (kind, a, b) pair the plan's groups connect, in a fixed order."""
    out = []
    for kind, groups, ring in (("tp", placement.tp_groups, True), ("dp", placement.dp_groups, True),
                               ("pp", placement.pp_groups, False)):
        out += [(kind, a, b) for g in groups for a, b in _chain(g, ring)]
    return out


def rounds(pairs: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
    """Greedy schedule: each round holds pairs with no rank in common (same on every rank)."""
    todo, out = list(pairs), []
    while todo:
        busy: set[int] = set()
        this, rest = [], []
        for p in todo:
            (rest if p[1] in busy or p[2] in busy else this).append(p)
            if p in this:
                busy.update(p[1:])
        out.append(this)
        todo = rest
    return out


@dataclass
class Pace:
    """The figures of the links measured so far, the same on every rank (each turn's figures are
    all-gathered, `_share`): what a new measurement is expected to reach. Kept across both
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


def _probe_numel(numel: int, n: int = 1) -> int:
    return max(n, numel // PROBE_DIV // n * n)


def pingpong(rank: int, peer: int, nbytes: int, device: torch.device, level: str,
             slow: Slowdown, limit_s: float = float("inf")) -> dict:
    """This end of a pair: ``gbps`` (one direction, best round trip); with ``cut_short`` and the
    probe's ``bytes`` when the probe showed the link far below ``limit_s``."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    probe = buf[:_probe_numel(buf.numel())]
    first = rank < peer

    def trip(t: torch.Tensor) -> None:
        if first:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        sync(device)

    trip(probe)  # lines the two ends up (and opens the connection), untimed
    probe_s = _best_of(lambda: trip(probe), PROBES, slow, f"p2p probe {peer}")
    # both ends must run the same number of trips, or one would wait for a trip that never
    # comes: they swap their probe times and decide from the slower one (and the same `limit_s`)
    mine = torch.tensor([probe_s], dtype=torch.float64, device=device)
    theirs = torch.empty_like(mine)
    if first:
        dist.send(mine, peer)
        dist.recv(theirs, peer)
    else:
        dist.recv(theirs, peer)
        dist.send(mine, peer)
    count = timed_iterations(max(probe_s, float(theirs.item())), buf.numel() / probe.numel(),
                             limit_s, level)
    if count == 0:
        return {"gbps": 2 * probe.numel() * 4 / probe_s / 1e9, "bytes": probe.numel() * 4,
                "cut_short": True}
    trip(buf)  # full-size warm-up
    best = _best_of(lambda: trip(buf), count, slow, f"p2p {peer}")
    return {"gbps": 2 * nbytes / best / 1e9}


def _share(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (as many on every rank), on every rank: a turn's figures, so
    that each rank updates the same `Pace` and rank 0 can report progress. A collective on the
    whole job: it also ends the turn, as a barrier would."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    return [g.tolist() for g in got]


def _turns(items: list, concurrent: bool) -> list[list]:
    return rounds(items) if concurrent else [[it] for it in items]


def _keep_best(best: dict[tuple, dict], items: list[dict], key: str, higher: bool) -> None:
    """Per item (same kind, op, ranks) keep the best ``key`` over the passes."""
    for it in items:
        k = (it["kind"], it.get("op"), tuple(it["ranks"]))
        if k not in best or (it[key] > best[k][key]) == higher:
            best[k] = it


def _where(ranks: list[int], nodes: list[str] | None) -> str:
    if not nodes:
        return ""
    return " on " + "<->".join(dict.fromkeys(nodes[r] for r in ranks))


def measure_pairs(rank: int, placement: Placement, device: torch.device, level: str,
                  slow: Slowdown, only: set[tuple[str, int, int]] | None = None,
                  pace: Pace | None = None, progress: LinkProgress | None = None,
                  nodes: list[str] | None = None) -> list[dict]:
    """This rank's pairs: kind, ranks, GB/s as seen from this end (best of the passes).
    ``only``: measure just these (kind, a, b) pairs (the re-measurement of suspects); it must
    be the same on every rank. ``pace``: the figures so far (the same on every rank);
    ``progress`` (rank 0): where to report; ``nodes``: each rank's node, for that report."""
    pace = Pace() if pace is None else pace
    pairs = [p for p in plan_pairs(placement) if only is None or p in only]
    progress = progress or LinkProgress("p2p", "pairs", 0, None)
    progress.total, progress.passes = len(pairs) * PASSES[level], PASSES[level]
    best: dict[tuple, dict] = {}
    cut: set[tuple] = set()  # the same on every rank: every rank skips the same turns
    for _ in range(PASSES[level]):
        todo = [p for p in pairs if p not in cut]
        progress.add([], items=len(pairs) - len(todo))
        _keep_best(best, _pairs_once(rank, placement, device, level, slow, todo, pace, cut,
                                     progress, nodes), "gbps", higher=True)
    progress.finish()
    return list(best.values())


def _pairs_once(rank: int, placement: Placement, device: torch.device, level: str,
                slow: Slowdown, pairs: list[tuple[str, int, int]], pace: Pace,
                cut: set[tuple], progress: LinkProgress,
                nodes: list[str] | None) -> list[dict]:
    nbytes = BYTES[(device.type if device.type == "cuda" else "cpu", level)]
    concurrent = device.type == "cuda"
    out = []
    for turn in _turns(pairs, concurrent):
        mine = [float("nan"), 0.0]
        for kind, a, b in turn:
            if rank in (a, b):
                local = placement.node(a) == placement.node(b)
                it = pingpong(rank, b if rank == a else a, nbytes, device, level, slow,
                              pace.limit_s("p2p", local, 2 * nbytes, level))
                out.append({"kind": kind, "ranks": [a, b], **it})
                mine = [it["gbps"], float(it.get("cut_short", False))]
        got = _share(mine, device)
        figures = []
        for kind, a, b in turn:
            gbps = min(got[a][0], got[b][0])  # the pair's figure: its slower end's
            was_cut = got[a][1] > 0 or got[b][1] > 0
            if was_cut:
                cut.add((kind, a, b))
            else:  # only full measurements set what the next ones expect
                pace.add("p2p", placement.node(a) == placement.node(b), gbps)
            figures.append((f"{kind} pair {a}<->{b}{_where([a, b], nodes)}", gbps, "GB/s",
                            was_cut))
        progress.add(figures)
    return out


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for an op on n ranks."""
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def _collective(op: str, group, n: int, numel: int, device: torch.device):
    """The op as train issues it (`mscale.distributed.collectives`: on gloo a reduce-scatter is
    an all-reduce and a copy, as in training), on buffers of ``numel`` fp32 elements."""
    if op == "allreduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if op == "allgather":
        part, full = torch.ones(numel // n, device=device), torch.empty(numel, device=device)
        return lambda: all_gather_into(full, part, group)
    full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
    return lambda: reduce_scatter_into(part, full, group, scratch=True)


def measure_groups(groups: ParallelGroups, device: torch.device, level: str,
                   slow: Slowdown, only: set[tuple[str, tuple[int, ...]]] | None = None,
                   pace: Pace | None = None, progress: LinkProgress | None = None,
                   nodes: list[str] | None = None) -> list[dict]:
    """This rank's view of each collective on each of its groups (best of the passes).
    ``only``: just these (kind, members) groups, the same on every rank; ``pace``,
    ``progress``, ``nodes``: as for `measure_pairs`."""
    pace = Pace() if pace is None else pace
    placement = groups.placement
    todo = [(kind, tuple(m)) for kind in KINDS for m in getattr(placement, f"{kind}_groups")
            if len(m) >= 2 and (only is None or (kind, tuple(m)) in only)]
    progress = progress or LinkProgress("collectives", "groups", 0, None)
    progress.total, progress.passes = len(todo) * PASSES[level], PASSES[level]
    best: dict[tuple, dict] = {}
    cut: set[tuple] = set()  # the same on every rank: every rank skips the same turns
    for _ in range(PASSES[level]):  # by algbw: a pass cut short timed a smaller buffer
        progress.add([], items=sum(1 for g in todo if g in cut))
        _keep_best(best, _groups_once(groups, device, level, slow, only, pace, cut, progress,
                                      nodes), "algbw", higher=True)
    progress.finish()
    return list(best.values())


def _groups_once(groups: ParallelGroups, device: torch.device, level: str,
                 slow: Slowdown, only: set[tuple[str, tuple[int, ...]]] | None, pace: Pace,
                 cut: set[tuple], progress: LinkProgress, nodes: list[str] | None) -> list[dict]:
    """One pass over the groups, but those with a collective cut short in an earlier pass;
    each turn's figures are shared (`_share`), which also ends the turn."""
    nbytes = BYTES[(device.type if device.type == "cuda" else "cpu", level)]
    concurrent = device.type == "cuda"
    placement = groups.placement
    out = []
    for kind in KINDS:
        mine = getattr(groups, f"{kind}_ranks")
        if len(mine) < 2:
            continue  # every group of a kind has the same size: the same skip on every rank
        every = [tuple(m) for m in getattr(placement, f"{kind}_groups")]
        wanted = [m for m in every  # the same on every rank
                  if (only is None or (kind, m) in only) and (kind, m) not in cut]
        # on GPUs a kind's groups run at once (each has its own links), on CPUs one at a time
        turns = ([wanted] if wanted else []) if concurrent else [[m] for m in wanted]
        for turn in turns:
            figures = [float("nan")] * (2 * len(COLLECTIVES))
            if tuple(mine) in turn:
                local = len({placement.node(r) for r in mine}) == 1
                timed = _time_group(kind, mine, getattr(groups, f"{kind}_group"), nbytes,
                                    device, level, slow, pace, local)
                out += timed
                for i, it in enumerate(timed):
                    figures[2 * i: 2 * i + 2] = [it["algbw"], float(it.get("cut_short", False))]
            got = _share(figures, device)
            done = []
            for members in turn:
                local = len({placement.node(r) for r in members}) == 1
                for i, op in enumerate(COLLECTIVES):
                    algbw = min(got[r][2 * i] for r in members)  # the slowest member's
                    was_cut = any(got[r][2 * i + 1] > 0 for r in members)
                    if was_cut:
                        cut.add((kind, members))
                    else:
                        pace.add(op, local, algbw)
                    done.append((f"{op} {kind}[{','.join(map(str, members))}]"
                                 f"{_where(list(members), nodes)}",
                                 algbw * bus_factor(op, len(members)), "GB/s busbw", was_cut))
            progress.add(done, items=len(turn))
    return out


def _time_group(kind: str, members: list[int], group, nbytes: int, device: torch.device,
                level: str, slow: Slowdown, pace: Pace | None = None,
                local: bool = False) -> list[dict]:
    """Best time of each collective on one group, from this member's side. Each starts with a
    probe (`PROBE_DIV`); one far below what ``pace`` expects is cut short there."""
    n, out = len(members), []
    for op in COLLECTIVES:
        numel = (nbytes // 4) // n * n
        small = _probe_numel(numel, n)
        probe = _collective(op, group, n, small, device)
        probe()  # lines the members up (and opens the connections), untimed
        sync(device)
        lined_up = lambda: dist.barrier(group=group)  # noqa: E731
        took = _best_of(lambda: (probe(), sync(device)), PROBES, slow, f"{kind} {op} probe",
                        lined_up)
        # every member decides from the slowest member's probe and the same `pace`: the same
        # decision everywhere, so no member waits for an iteration the others skip
        slowest = torch.tensor([took], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        limit = (float("inf") if pace is None else pace.limit_s(op, local, numel * 4, level))
        count = timed_iterations(float(slowest.item()), numel / small, limit, level)
        if count == 0:
            algbw = small * 4 / took / 1e9
            out.append({"kind": kind, "op": op, "ranks": members, "seconds": took,
                        "bytes": small * 4, "algbw": algbw, "busbw": algbw * bus_factor(op, n),
                        "cut_short": True})
            continue
        run = _collective(op, group, n, numel, device)
        run()  # full-size warm-up
        sync(device)
        best = _best_of(lambda: (run(), sync(device)), count, slow, f"{kind} {op}", lined_up)
        algbw = numel * 4 / best / 1e9
        out.append({"kind": kind, "op": op, "ranks": members, "seconds": best,
                    "bytes": numel * 4, "algbw": algbw, "busbw": algbw * bus_factor(op, n)})
    return out


def _best_of(fn, count: int, slow: Slowdown, label: str, line_up=lambda: None) -> float:
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
