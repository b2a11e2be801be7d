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
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mscale.distributed.collectives import all_gather_into, reduce_scatter_into
from mscale.distributed.groups import ParallelGroups
from mscale.preflight.compute import Slowdown, sync
from mscale.topology.placement import Placement

BYTES = {("cpu", "quick"): 4 << 20, ("cpu", "full"): 16 << 20, ("cuda", "quick"): 64 << 20,
         ("cuda", "full"): 512 << 20}
ITERS = {"quick": 10, "full": 30}
BUDGET_S = {"quick": 1.5, "full": 5.0}
"""Seconds a pair's or collective's timed iterations may take, judged from its warm-up: a link
sending at a tenth of its rate would otherwise hold the whole check (a re-check of a node with a
degraded NIC took over five minutes under SLURM); it is as slow in three trips as in thirty."""
MIN_ITERS = 3
PASSES = {"quick": 2, "full": 3}
"""Every pair and group is measured in this many passes over all of them, its best kept: a
burst of other load lasts a moment, so it spoils one pass of a link but not every pass, while
a slow device or link is slow in all of them."""
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


def pingpong_gbps(rank: int, peer: int, nbytes: int, device: torch.device, level: str,
                  slow: Slowdown) -> float:
    """Best GB/s (one direction) over round trips between ``rank`` and ``peer``."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    first = rank < peer

    def trip() -> None:
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        sync(device)

    t0 = time.perf_counter()
    trip()  # warm-up; also lines the two ends up
    # the lower rank decides how many trips fit the budget and tells its peer: both ends must
    # run the same number, or one would wait for a trip that never comes
    count = torch.tensor([iterations(time.perf_counter() - t0, level)], dtype=torch.int64,
                         device=device)
    if first:
        dist.send(count, peer)
    else:
        dist.recv(count, peer)
    best = float("inf")
    for _ in range(int(count.item())):
        t0 = time.perf_counter()
        trip()
        slow.after(t0, f"p2p {peer}")
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def iterations(warmup_s: float, level: str) -> int:
    """Timed iterations after a warm-up of ``warmup_s``: `ITERS`, fewer when they would not fit
    `BUDGET_S`, never fewer than `MIN_ITERS` (the best of a few still shows a slow link)."""
    fit = int(BUDGET_S[level] / max(warmup_s, 1e-9))
    return max(MIN_ITERS, min(ITERS[level], fit))


def _turns(items: list, concurrent: bool) -> list[list]:
    return rounds(items) if concurrent else [[it] for it in items]


def best_of_passes(measure, level: str, key: str, higher: bool) -> list[dict]:
    """Run ``measure()`` PASSES times; per item (same kind, op, ranks) keep the best ``key``."""
    best: dict[tuple, dict] = {}
    for _ in range(PASSES[level]):
        for it in measure():
            k = (it["kind"], it.get("op"), tuple(it["ranks"]))
            if k not in best or (it[key] > best[k][key]) == higher:
                best[k] = it
    return list(best.values())


def measure_pairs(rank: int, placement: Placement, device: torch.device, level: str,
                  slow: Slowdown, only: set[tuple[str, int, int]] | None = None) -> list[dict]:
    """This rank's pairs: kind, ranks, GB/s as seen from this end (best of the passes).
    ``only``: measure just these (kind, a, b) pairs (the re-measurement of suspects); it must
    be the same on every rank."""
    return best_of_passes(lambda: _pairs_once(rank, placement, device, level, slow, only), level,
                          "gbps", higher=True)


def _pairs_once(rank: int, placement: Placement, device: torch.device, level: str,
                slow: Slowdown, only: set[tuple[str, int, int]] | None) -> list[dict]:
    nbytes = BYTES[(device.type if device.type == "cuda" else "cpu", level)]
    concurrent = device.type == "cuda"
    pairs = [p for p in plan_pairs(placement) if only is None or p in only]
    out = []
    for turn in _turns(pairs, concurrent):
        for kind, a, b in turn:
            if rank in (a, b):
                gbps = pingpong_gbps(rank, b if rank == a else a, nbytes, device, level, slow)
                out.append({"kind": kind, "ranks": [a, b], "gbps": gbps})
        if not concurrent:
            dist.barrier()
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
                   slow: Slowdown, only: set[tuple[str, tuple[int, ...]]] | None = None
                   ) -> list[dict]:
    """This rank's view of each collective on each of its groups (best of the passes).
    ``only``: just these (kind, members) groups, the same on every rank."""
    return best_of_passes(lambda: _groups_once(groups, device, level, slow, only), level,
                          "seconds", higher=False)


def _groups_once(groups: ParallelGroups, device: torch.device, level: str,
                 slow: Slowdown, only: set[tuple[str, tuple[int, ...]]] | None) -> list[dict]:
    nbytes = BYTES[(device.type if device.type == "cuda" else "cpu", level)]
    concurrent = device.type == "cuda"
    placement = groups.placement
    out = []
    for kind in KINDS:
        mine = getattr(groups, f"{kind}_ranks")
        if len(mine) < 2:
            continue
        for members in [mine] if concurrent else getattr(placement, f"{kind}_groups"):
            if only is not None and (kind, tuple(members)) not in only:
                continue  # the same skip on every rank: the barrier below stays matched
            if members == mine:
                out += _time_group(kind, mine, getattr(groups, f"{kind}_group"), nbytes,
                                   device, level, slow)
            if not concurrent:
                dist.barrier()
    return out


def _time_group(kind: str, members: list[int], group, nbytes: int, device: torch.device,
                level: str, slow: Slowdown) -> list[dict]:
    """Best time of each collective on one group, from this member's side."""
    n, out = len(members), []
    for op in COLLECTIVES:
        numel = (nbytes // 4) // n * n
        run = _collective(op, group, n, numel, device)
        t0 = time.perf_counter()
        run()
        sync(device)
        # every member runs as many iterations as the slowest member's warm-up allows
        warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(warm, op=dist.ReduceOp.MAX, group=group)
        best = float("inf")
        for _ in range(iterations(float(warm.item()), level)):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            run()
            sync(device)
            slow.after(t0, f"{kind} {op}")
            best = min(best, time.perf_counter() - t0)
        algbw = numel * 4 / best / 1e9
        out.append({"kind": kind, "op": op, "ranks": members, "seconds": best,
                    "bytes": numel * 4, "algbw": algbw, "busbw": algbw * bus_factor(op, n)})
    return out
