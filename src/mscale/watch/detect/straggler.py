"""Slow ranks, nodes, links, data loaders and pipeline stages, each with the evidence that decided.

In a synchronous job every rank's step time is the same, so the split decides (docs/watch.md):
the rank everyone waits for has the highest busy time and the lowest wait. Each rank is compared
with its *stage* peers (stages legitimately differ: embedding, head, loss), row by row; the
per-rank excess is then taken as the median over the last ``persist_steps`` rows, so a rank is
named only when it was slow in most of them. A rank is slow when that excess passes both a
robust z-score across all ranks and a floor of ``min_excess_frac`` of the step time.

- compute high → the device (``slow_device``); most ranks of one node → the node (``slow_node``);
- data time high on a reading rank (TP rank 0) against its DP peers → the loader (``slow_data``);
- slow links are judged by their groups, not by ranks (detect/links.py): a rank that accounts
  for less time than its peers may be one that did untraced work (logging, a checkpoint
  writer), which is no link;
- one stage's median compute above the other stages' → ``stage_imbalance`` (re-plan), or
  ``slow_node`` when that stage is one node and was typical in the run's baseline (a change on
  one node is hardware; a split that was uneven from the start is the plan's).
"""

from __future__ import annotations

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.detect.onset import onset_step
from mscale.watch.detect.rows import Recent, median, robust_sigma
from mscale.watch.detect.split import fastest_split, split_gain_pct
from mscale.watch.findings import Finding
from mscale.watch.whatif import Grid, WhatIf

MIN_PEERS = 5


def _outliers(x: np.ndarray, eligible: np.ndarray, cfg: WatchConfig, step_s: float):
    """Mask of eligible ranks whose ``x`` passes the z-score and the floor; the bar; sigma.
    Below ``MIN_PEERS`` eligible ranks the MAD is mostly the outlier itself: the floor decides."""
    sigma = float(robust_sigma(x[eligible])) if eligible.sum() >= MIN_PEERS else 0.0
    bar = max(cfg.z_threshold * sigma, cfg.min_excess_frac * step_s)
    return eligible & (x > bar), bar, sigma


def _by_node(mask: np.ndarray, eligible: np.ndarray, g: Grid, cfg: WatchConfig):
    """Nodes where most eligible ranks are flagged (at least two), and the remaining ranks."""
    flagged = np.bincount(g.node[mask], minlength=g.nodes)
    size = np.bincount(g.node[eligible], minlength=g.nodes)
    whole = (flagged >= 2) & (flagged >= cfg.node_fraction * size)
    return np.flatnonzero(whole), np.flatnonzero(mask & ~whole[g.node])


def _node_median(x: np.ndarray, g: Grid) -> np.ndarray:
    """``[world]`` → ``[nodes]``: the median rank of each node."""
    size = g.world // g.nodes
    if size * g.nodes == g.world:
        return median(x.reshape(g.nodes, size), axis=1)
    return np.array([median(x[g.node == n]) for n in range(g.nodes)])


def _over_rows(x: np.ndarray) -> np.ndarray:
    """Median over the rows (axis 0) of a short window: a sort of a few rows is a third of
    ``np.median``'s cost across 12,288 columns."""
    s = np.sort(x, axis=0)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2


def _nanmedian(x: np.ndarray) -> np.ndarray:
    """Median over the last axis ignoring NaN (NaN where all are): a sort, where numpy's
    nanmedian of many short rows goes through masked arrays and costs a hundred times more."""
    s = np.sort(x, axis=-1)  # NaN sort last
    k = (~np.isnan(x)).sum(axis=-1)
    flat = s.reshape(-1, s.shape[-1])  # one row per slice: plain indexing, not take_along_axis
    rows = np.arange(len(flat))
    lo = flat[rows, (np.maximum(k - 1, 0) // 2).ravel()].reshape(k.shape)
    hi = flat[rows, (k // 2 - (k == 0)).ravel()].reshape(k.shape)
    return np.where(k > 0, (lo + hi) / 2, np.nan)


def _typical(x: np.ndarray, g: Grid, exclude: np.ndarray | None, peers: str) -> np.ndarray:
    """``[n, world]``: per row, what a typical peer of each rank has, the median over its peers
    outside ``exclude`` (all of them where none is left). Peers: ``"stage"``, every rank of the
    stage; ``"dp"``, the DP replicas of the same stage and TP position."""
    n, given = len(x), x
    if exclude is not None and exclude.any():
        x = np.where(exclude, np.nan, x)
    grid = x.reshape(n, g.pp, g.dp, g.tp)
    if peers == "stage":
        med = _nanmedian(grid.reshape(n, g.pp, g.dp * g.tp))[:, g.stage]
    else:
        med = _nanmedian(np.swapaxes(grid, -1, -2))[:, g.stage, g.tp_rank]
    if exclude is not None and np.isnan(med).any():  # a group with every rank excluded
        med = np.where(np.isnan(med), _typical(given, g, None, peers), med)
    return med


class StragglerRules:
    """The windowed per-rank and per-stage rules over one `Recent` window."""

    def __init__(self, grid: Grid, config: WatchConfig):
        self.g, self.cfg = grid, config
        self.excess: np.ndarray | None = None
        """Each rank's windowed busy excess at the last judgement (the summary's slowest)."""

    def _excess(self, x: np.ndarray, eligible: np.ndarray, peers: str, step_s: float):
        """Windowed excess of each rank over a typical peer, in two passes: flag against all
        peers, then measure against the peers outside flagged ranks and outside nodes whose
        median rank looks slow (a slow node may be half of a stage). Also the per-row excess
        ``[n, world]`` the windowed one is the median of (the onset is read off it)."""
        g, exclude = self.g, None
        floor = self.cfg.min_excess_frac * step_s
        for _ in range(2):
            typ = _typical(x, g, exclude, peers)
            per_row = x - typ
            ex = _over_rows(per_row)
            slow, bar, sig = _outliers(ex, eligible, self.cfg, step_s)
            # half of the floor, not of the bar: when a slow node is half of a small stage (dp
            # 2, a node a TP group) the stage median lies between the halves, every rank is a
            # full excess away from it, and the spread (so the bar) is the fault's own size
            exclude = slow | (_node_median(ex, g) > min(bar, floor) / 2)[g.node]
        return ex, slow, bar, sig, typ, per_row

    def judge(self, w: Recent, whatif: WhatIf, base_stage: np.ndarray | None) -> list[Finding]:
        g, cfg = self.g, self.cfg
        step_s = float(median(w.step_time))
        everyone = np.ones(g.world, bool)
        c_ex, slow_c, bar_c, sig_c, typ_c, rows_c = self._excess(w.compute, everyone, "stage",
                                                                 step_s)
        d_ex, slow_d, bar_d, sig_d, typ_d, rows_d = self._excess(w.data, g.reader, "dp", step_s)
        busy = slow_c | slow_d
        whole_c, _ = _by_node(slow_c, everyone, g, cfg)
        busy = busy | np.isin(g.node, whole_c)
        waits_less = -_over_rows(w.wait - _typical(w.wait, g, busy, "stage"))
        self.excess = c_ex + d_ex * g.reader
        found: list[Finding] = []
        common = {"window_steps": [int(w.steps[0]), int(w.steps[-1])], "step_s": step_s}
        ctx = (waits_less, w, whatif, typ_c, typ_d, common)
        for cause, mask, ex, bar, sig, elig, rows in (
                ("slow_device", slow_c, c_ex, bar_c, sig_c, everyone, rows_c),
                ("slow_data", slow_d, d_ex, bar_d, sig_d, g.reader, rows_d)):
            nodes, ranks = _by_node(mask, elig, g, cfg)
            for node in nodes:
                members = np.flatnonzero(mask & (g.node == node))
                found.append(self._finding(cause, members, int(node), (ex, rows), bar, sig, ctx))
            for r in ranks[np.argsort(-ex[ranks])][: cfg.max_findings]:
                found.append(self._finding(cause, np.array([r]), None, (ex, rows), bar, sig,
                                           ctx))
        found = [f for f in found if (f.slowdown_pct or 0.0) >= cfg.min_slowdown_pct]
        found.sort(key=lambda f: -(f.slowdown_pct or 0.0))
        stage = self._stage(w, whatif, typ_c, base_stage, common)
        return found[: cfg.max_findings] + ([stage] if stage else [])

    def _finding(self, cause: str, members: np.ndarray, node: int | None,
                 excess_rows: tuple[np.ndarray, np.ndarray], bar: float, sig: float,
                 ctx) -> Finding:
        """``excess_rows``: each rank's windowed excess ``[world]`` and per-row one
        ``[n, world]``. Dated by its onset: the rows where the members' mean excess passed the
        bar (detect/onset.py), not the window's first row, which lies before the fault; its
        excess and what-if cost are measured on the rows from the onset on (as a slow link's
        are, detect/links.py), so a fault found a few rows in is not announced at a fraction
        of what it costs."""
        g = self.g
        ex, rows = excess_rows
        waits_less, w, whatif, typ_c, typ_d, common = ctx
        first = onset_step(w.steps, np.mean(rows[:, members], axis=1) > bar)
        after = w.steps >= first  # priced on the rows since the onset: those before were healthy
        fixed = whatif.typical_ranks(w.compute, w.data, members, typ_c, typ_d)
        pct, saved = whatif.slowdown(w.own[after], fixed[after], w.step_time[after])
        if cause == "slow_device" and node is not None:
            cause = "slow_node"
        excess = float(np.mean(_over_rows(rows[after][:, members])))
        what = {"slow_device": "compute", "slow_node": "compute", "slow_data": "data time"}[cause]
        evidence = {**common, "rule": _RULES[cause], "excess_s": excess, "threshold_s": bar,
                    "z": excess / sig if sig > 0 else None, "saved_s": saved,
                    "wait_deficit_s": float(np.mean(waits_less[members])),
                    "stages": sorted({int(s) for s in g.stage[members]}),
                    "priced_steps": [first, int(w.steps[-1])], "priced_rows": int(after.sum()),
                    "decided_by": f"{what} {float(np.mean(ex[members])):+.3g} s against its "
                                  f"peers' median (bar {bar:.3g} s) over {len(w)} judged "
                                  f"steps; priced on the {int(after.sum())} from step {first} "
                                  f"on"}
        if node is not None:
            ranks = g.node_ranks(node)
            evidence["slow_ranks_on_node"] = [int(r) for r in members]
            where, nodes = f"node {g.name(node)} ({len(members)} of {len(ranks)} ranks)", \
                [g.name(node)]
        else:
            r = int(members[0])
            ranks, nodes = [r], [g.name(int(g.node[r]))]
            where = f"rank {r} on {nodes[0]}"
        message = f"{where}: {_SAYS[cause]}, {excess:.3g} s above its peers per step; " \
                  f"the job is {pct:.0f}% slower because of it"
        return Finding(kind="straggler", severity="warning", message=message, cause=cause,
                       ranks=ranks, nodes=nodes, first_step=first,
                       last_step=int(w.steps[-1]), slowdown_pct=pct, evidence=evidence,
                       advice=_ADVICE[cause].format(node=nodes[0]))

    def _stage(self, w: Recent, whatif: WhatIf, typ_c: np.ndarray,
               base_stage: np.ndarray | None, common: dict) -> Finding | None:
        """The heaviest pipeline stage, when making it typical would buy enough."""
        g, cfg = self.g, self.cfg
        if g.pp < 2:
            return None
        typ_c = typ_c[:, :: g.dp * g.tp]  # [n, pp]: a stage's ranks share one typical value
        sc = median(typ_c, axis=0)
        excess = np.array([sc[s] - median(np.delete(sc, s)) for s in range(g.pp)])
        s = int(excess.argmax())
        if excess[s] <= 0:
            return None
        pct, saved = whatif.slowdown(w.own, whatif.typical_stage(w.compute, w.data, s, typ_c),
                                     w.step_time)
        if pct < cfg.stage_min_slowdown_pct:
            return None
        nodes = np.unique(g.node[g.stage == s])
        was = None if base_stage is None else float(base_stage[s])
        changed = bool(was is not None and was < 0.5 * excess[s])
        evidence = {**common, "stage": s, "stage_compute_s": [float(x) for x in sc],
                    "excess_s": float(excess[s]), "baseline_excess_s": was, "saved_s": saved,
                    "micro_batches": whatif.micro_batches}
        same = dict(kind="straggler", severity="warning",
                    first_step=_stage_onset(w.steps, typ_c, s, excess[s], was, changed),
                    last_step=int(w.steps[-1]), slowdown_pct=pct, evidence=evidence)
        if changed and len(nodes) == 1:
            node = g.name(int(nodes[0]))
            evidence.update(rule=_RULES["slow_node"] + "; the node is the whole stage and the "
                            "stage was typical in the baseline",
                            decided_by=f"stage {s} (only {node}) rose from "
                                       f"{was:+.3g} s to {excess[s]:+.3g} s over the others")
            return Finding(cause="slow_node", ranks=g.node_ranks(int(nodes[0])), nodes=[node],
                           message=f"node {node} (all of stage {s}) became slow: "
                                   f"{excess[s]:.3g} s above the other stages per step; the "
                                   f"job is {pct:.0f}% slower because of it",
                           advice=_ADVICE["slow_node"].format(node=node), **same)
        advice, than = _ADVICE["stage_imbalance"], "because of it"
        counts = g.layout.stage_layers
        if counts is not None and len(counts) == g.pp:
            best, per_block = fastest_split(sc, list(counts), whatif.graph)
            if best == list(counts):
                return None  # no integer split is faster: nothing to advise
            if split_gain_pct(sc, list(counts), best, per_block, whatif.graph) \
                    < cfg.stage_min_slowdown_pct:
                return None  # faster by the model only by noise: not worth a re-plan
            moved = (np.asarray(best) - np.asarray(counts)) * per_block
            pct, saved = whatif.slowdown(w.own, w.compute + moved[g.stage] + w.data,
                                         w.step_time)
            if pct < cfg.stage_min_slowdown_pct:
                return None
            evidence.update(stage_layers=list(counts), best_stage_layers=best,
                            per_block_s=per_block, saved_s=saved)
            same["slowdown_pct"] = pct
            than = f"than with stage_layers {best}"
            advice = (f"re-plan with stage_layers {best} (the best integer split of the "
                      f"{sum(counts)} blocks; now {list(counts)}): {_REPLAN.format(best)}; no "
                      f"node is at fault")
        evidence.update(rule=_RULES["stage_imbalance"], changed_since_baseline=changed,
                        decided_by=f"stage {s} computes {excess[s]:.3g} s more than the median "
                                   f"of the other stages, on all of its ranks")
        return Finding(cause="stage_imbalance", advice=advice,
                       message=f"pipeline stage {s} of {g.pp} computes {excess[s]:.3g} s more "
                               f"per step than the others; the job is {pct:.0f}% slower "
                               f"{than}", **same)


def _stage_onset(steps: np.ndarray, stage_typ: np.ndarray, s: int, excess: float,
                 was: float | None, changed: bool) -> int:
    """The first step of the stretch in which stage ``s`` computed more than the other stages.
    ``stage_typ``: ``[n, pp]`` each stage's typical compute per row. A row counts when the
    stage's excess in it is past the middle between its old level (the baseline's, when the
    stage changed since; none otherwise) and its windowed level: an imbalance the plan made is
    there in every row, so it is dated by the window's start, and a stage that became slow by
    the rows since it did."""
    others = median(np.delete(stage_typ, s, axis=1), axis=1)
    old = max(was, 0.0) if changed and was is not None else 0.0
    return onset_step(steps, stage_typ[:, s] - others > (old + excess) / 2)


_RULES = {
    "slow_device": "one rank's compute persistently above its stage peers, its wait the lowest",
    "slow_node": "most ranks of one node persistently above their stage peers",
    "slow_data": "a reading rank's data time persistently above its DP peers'",
    "stage_imbalance": "every rank of one pipeline stage computes more than the other stages",
}
_SAYS = {
    "slow_device": "the device is slow",
    "slow_node": "the node is slow",
    "slow_data": "its data loading is slow",
}
_ADVICE = {
    "slow_device": "checkpoint, then take {node} out of the job (quarantine) and resume",
    "slow_node": "checkpoint, then take {node} out of the job (quarantine) and resume",
    "slow_data": "look at the data source and the loader on {node} (storage, loader workers, "
                 "prefetch); no node needs to leave the job",
    "stage_imbalance": "re-plan the pipeline split (give this stage fewer layers): set "
                       "layout.stage_layers in the plan file, then check and rewrite it with "
                       "`mscale plan --cluster C --model M --training T --layout PLAN "
                       "--keep-given -o PLAN` and relaunch with it; no node is at fault",
}

_REPLAN = ("set `layout.stage_layers: {}` in the plan file (mscale plan has no option for it), "
           "check and rewrite it with `mscale plan --cluster C --model M --training T --layout "
           "PLAN --keep-given -o PLAN` (the files the plan was made from), and relaunch with it")
"""How a split is given: only in the layout YAML or plan; `--layout` with `--keep-given` prices
that layout and writes it (docs/plan.md)."""
