"""Point-to-point bandwidth on the pairs the plan's groups connect.

Pairs: consecutive members of each TP and DP group (the ring neighbours a ring collective
uses; both ends of a 2-member group) and consecutive pipeline stages of each PP group (the
activations' path). On GPUs they are measured in rounds in which no rank is in two pairs, so a
pair's figure is its own link's; on CPUs one pair at a time, since there every "link" shares
the same cores and concurrent tests would measure each other. Both ends of a pair report their
best round trip; the pair's figure is the slower end's. Probes, passes and cutting a slow link
short: `pace.py`; the collectives on each group: `busbw.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mscale.preflight.compute import Slowdown, sync
from mscale.preflight.pace import (BYTES, PASSES, PROBES, Pace, best_of, keep_best, on_nodes,
                                   probe_numel, share, timed_iterations)
from mscale.preflight.progress import LinkProgress
from mscale.topology.placement import Placement


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
    for kind, groups, ring in (("tp", placement.tp_groups, True),
                               ("dp", placement.dp_groups, True),
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


def pingpong(rank: int, peer: int, nbytes: int, device: torch.device, level: str,
             slow: Slowdown, limit_s: float = float("inf")) -> dict:
    """This end of a pair: ``gbps`` (one direction, best round trip); with ``cut_short`` and the
    probe's ``bytes`` when the probe showed the link far below ``limit_s``."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    probe = buf[:probe_numel(buf.numel())]
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
    probe_s = best_of(lambda: trip(probe), PROBES, slow, f"p2p probe {peer}")
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
    best = best_of(lambda: trip(buf), count, slow, f"p2p {peer}")
    return {"gbps": 2 * nbytes / best / 1e9}


def _turns(items: list, concurrent: bool) -> list[list]:
    return rounds(items) if concurrent else [[it] for it in items]


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
        keep_best(best, _pairs_once(rank, placement, device, level, slow, todo, pace, cut,
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
        got = share(mine, device)
        figures = []
        for kind, a, b in turn:
            gbps = min(got[a][0], got[b][0])  # the pair's figure: its slower end's
            was_cut = got[a][1] > 0 or got[b][1] > 0
            if was_cut:
                cut.add((kind, a, b))
            else:  # only full measurements set what the next ones expect
                pace.add("p2p", placement.node(a) == placement.node(b), gbps)
            figures.append((f"{kind} pair {a}<->{b}{on_nodes([a, b], nodes)}", gbps, "GB/s",
                            was_cut))
        progress.add(figures)
    return out
