"""Bus bandwidth of each collective on each of the plan's TP, PP and DP groups.

All-reduce, all-gather and reduce-scatter on this rank's groups as built by
`mscale.distributed.groups.build_groups`, the code train uses, issued as train issues them.
Bandwidths follow nccl-tests (docs/references.md): algbw = S / t; busbw = algbw × 2(n−1)/n for
all-reduce and × (n−1)/n for all-gather and reduce-scatter, S the largest buffer (the full
output of an all-gather, the full input of a reduce-scatter). On GPUs a kind's groups run at
once (each has its own links), on CPUs one at a time. Probes, passes and cutting a slow group
short: `pace.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mscale.distributed.collectives import all_gather_into, reduce_scatter_into
from mscale.distributed.groups import ParallelGroups
from mscale.preflight.compute import Slowdown, sync
from mscale.preflight.pace import (BYTES, PASSES, PROBES, Pace, best_of, keep_best, on_nodes,
                                   probe_numel, share, timed_iterations)
from mscale.preflight.progress import LinkProgress

KINDS = ("tp", "pp", "dp")
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")


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
        keep_best(best, _groups_once(groups, device, level, slow, only, pace, cut, progress,
                                     nodes), "algbw", higher=True)
    progress.finish()
    return list(best.values())


def _groups_once(groups: ParallelGroups, device: torch.device, level: str,
                 slow: Slowdown, only: set[tuple[str, tuple[int, ...]]] | None, pace: Pace,
                 cut: set[tuple], progress: LinkProgress, nodes: list[str] | None) -> list[dict]:
    """One pass over the groups, but those with a collective cut short in an earlier pass;
    each turn's figures are shared (`share`), which also ends the turn."""
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
                timed = time_group(kind, mine, getattr(groups, f"{kind}_group"), nbytes,
                                    device, level, slow, pace, local)
                out += timed
                for i, it in enumerate(timed):
                    figures[2 * i: 2 * i + 2] = [it["algbw"], float(it.get("cut_short", False))]
            got = share(figures, device)
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
                                 f"{on_nodes(list(members), nodes)}",
                                 algbw * bus_factor(op, len(members)), "GB/s busbw", was_cut))
            progress.add(done, items=len(turn))
    return out


def time_group(kind: str, members: list[int], group, nbytes: int, device: torch.device,
               level: str, slow: Slowdown, pace: Pace | None = None,
               local: bool = False) -> list[dict]:
    """Best time of each collective on one group, from this member's side. Each starts with a
    probe (`PROBE_DIV`); one far below what ``pace`` expects is cut short there."""
    n, out = len(members), []
    for op in COLLECTIVES:
        numel = (nbytes // 4) // n * n
        small = probe_numel(numel, n)
        probe = _collective(op, group, n, small, device)
        probe()  # lines the members up (and opens the connections), untimed
        sync(device)
        lined_up = lambda: dist.barrier(group=group)  # noqa: E731
        took = best_of(lambda: (probe(), sync(device)), PROBES, slow, f"{kind} {op} probe",
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
        best = best_of(lambda: (run(), sync(device)), count, slow, f"{kind} {op}", lined_up)
        algbw = numel * 4 / best / 1e9
        out.append({"kind": kind, "op": op, "ranks": members, "seconds": best,
                    "bytes": numel * 4, "algbw": algbw, "busbw": algbw * bus_factor(op, n)})
    return out
