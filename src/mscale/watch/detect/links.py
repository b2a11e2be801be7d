"""Slow links: the group of one kind whose traffic is slower than its peer groups', and the node
that every slow group shares.

A degraded NIC crashes nothing: every collective and pipeline transfer that touches it slows,
and since the job is synchronous every rank then waits, so per-rank wait alone says "the
network" and names no one. What does point at the link is the *group*: every TP group runs the
same collectives on the same bytes, every DP group the same reduction, so groups of one kind are
peers of each other, and the one that is persistently
slower than its peers holds the link (MegaScale, NSDI 2024, §5: per-group timing and the
intersection of the slow groups).

The value of a group is the *smallest* time any of its members spent in that kind of
communication. A collective's last member to arrive waits only for the transfer itself; the
others also wait for it to arrive. So the minimum is the transfer, and a rank that is merely
late, because it did work the timers do not trace (rank 0 writing logs, a checkpoint writer, a
GC pause), raises its peers' wait but not the group's minimum: no node is blamed for what is not
a link. A slow link raises even its own rank's time, since its transfers take longer for
everyone in the group.

A degraded NIC slows only what leaves its node: TP inside a node rides NVLink, so on a
cluster the evidence is the DP groups and pipeline pairs that cross the NIC (`KINDS`).

The rule, row by row over the last ``persist_steps`` judged rows (detect/rows.py):
1. per kind (`KINDS`), each group's value minus the median of the *other* groups of that kind
   in its block of peers (a stage for TP and DP groups: stages hold different layers, so
   different collectives and gradient bytes; a stage boundary for pipeline pairs; all stages
   for ``dpx``; leave-one-out, so two groups a block suffice), over the rows: the group's
   excess is the value it passes in three rows of four (`PERSIST_QUANTILE`). A degraded link
   is slow in every row; a pair of processes starved of CPU for a few steps (8 ranks on 2
   cores) is slow in some rows and fast in others, and a median over the rows named such a
   pair once on a healthy SLURM run;
2. a group is slow when its excess passes a robust z-score across its kind's groups (with enough
   groups), a quarter of the floor ``min_excess_frac`` of the step, and ``link_min_ratio`` times
   the peers' value (a degraded link is a factor, not a few percent);
3. the suspects are the nodes in every slow TP and DP group, narrowed by the pipeline pairs and
   the ``dpx`` groups (`_suspects`: those two kinds alone never make a finding). One suspect,
   once the slow groups' excess (the largest of each record vector, added up) passes the whole
   floor, is named. Several (a DP group over two nodes and nothing else) are listed, and no
   node is named: naming the wrong one would send a healthy node out of the job, so the finding
   says how to separate them instead (`_suspects_finding`).
"""

from __future__ import annotations

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.detect.onset import onset_step
from mscale.watch.detect.rows import median, robust_sigma
from mscale.watch.findings import Finding
from mscale.watch.whatif import Grid, WhatIf, model_step

KINDS = ("tp", "dp", "pp", "dpx")
"""The kinds judged, each against its own peers:

- ``tp``: a stage's TP groups (its DP replicas) against each other;
- ``dp``: a stage's DP groups (its TP positions) against each other;
- ``pp``: the pipeline pairs of one stage boundary (one per DP replica and TP position) against
  each other. Both ends of a pair also wait on the rest of the pipeline (a slow device two
  stages away raises both), so a pair alone never names a node: it only narrows the suspects
  to its two nodes, and another kind must cut them to one;
- ``dpx``: every DP group against those of all stages. A degraded NIC slows every DP group
  through its node alike, and where a stage's DP groups all cross it (a DP group over two
  nodes, both of them the node's) none is slower than its stage's peers; the other stages'
  groups, which reduce a like share of the model over other nodes, are the peers left."""
SOURCE = {"tp": "tp", "dp": "dp", "pp": "pp", "dpx": "dp"}
"""The record's ``comm_<source>`` vector each kind is read from."""
LABEL = {"tp": "TP group", "dp": "DP group", "pp": "pipeline pair",
         "dpx": "DP group (against every stage's)"}
PERSIST_QUANTILE = 0.25
"""The quantile over the window's rows of a group's excess that judges it: a group is slow only
if it is slower than its peers in three rows of four."""
MIN_PEERS = 5
"""Below this many groups of a kind the spread is mostly the outlier itself: the floors decide."""


def group_members(g: Grid, kind: str) -> np.ndarray:
    """``[groups, size]`` ranks of each group of ``kind``, in the order `group_values` uses:
    peer blocks (`blocks`) are contiguous."""
    ranks = np.arange(g.world).reshape(g.pp, g.dp, g.tp)
    if kind == "tp":
        return ranks.reshape(g.pp * g.dp, g.tp)
    if kind == "pp":  # boundary-major: [boundary, dp, tp] pairs of (stage b, stage b + 1)
        return np.stack([ranks[:-1], ranks[1:]], axis=-1).reshape(-1, 2)
    return np.swapaxes(ranks, 1, 2).reshape(g.pp * g.tp, g.dp)


def blocks(g: Grid, kind: str) -> int:
    """How many blocks of peers the groups of ``kind`` fall into (stages, boundaries, or one)."""
    return {"tp": g.pp, "dp": g.pp, "pp": g.pp - 1, "dpx": 1}[kind]


def kinds_of(g: Grid) -> list[str]:
    """The kinds with at least two peer groups of two members in a block: a stage's TP groups
    are its dp replicas and its DP groups its tp positions, so both need tp > 1 and dp > 1; a
    boundary has dp x tp pairs; the DP groups of all stages are pp x tp."""
    out = ["tp", "dp"] if g.tp > 1 and g.dp > 1 else []
    if g.pp > 1 and g.dp * g.tp > 1:
        out.append("pp")
    if g.pp > 1 and g.dp > 1:
        out.append("dpx")
    return out


def has_groups(g: Grid) -> bool:
    """Whether any kind can be judged (`kinds_of`)."""
    return bool(kinds_of(g))


def group_values(g: Grid, kind: str, x: np.ndarray) -> np.ndarray:
    """``[world]`` seconds → ``[groups]``: each group's smallest member time (the transfer)."""
    return x[group_members(g, kind)].min(axis=1)


class LinkRows:
    """The last rows' group values per kind, in a ring as small as the groups (not the ranks)."""

    def __init__(self, grid: Grid, capacity: int):
        self.g, self.cap = grid, capacity
        self.kinds = kinds_of(grid)
        self.values = {k: np.zeros((capacity, len(group_members(grid, k)))) for k in self.kinds}
        self.steps = np.zeros(capacity, np.int64)
        self.step_time = np.zeros(capacity)
        self.active = np.full((capacity, grid.world), np.nan)  # per rank: step less waits
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def sources(self) -> list[str]:
        """The record's vectors the kinds are read from (``tp``, ``pp``, ``dp``)."""
        return sorted({SOURCE[k] for k in self.kinds})

    def append(self, step: int, step_time: float, per_source: dict[str, np.ndarray],
               active: np.ndarray | None = None) -> None:
        """One row: ``per_source[s]`` is the record's ``[world]`` ``comm_<s>`` vector;
        ``active`` each rank's step time less its waits (`explained_pairs`), if known."""
        i = self.n % self.cap
        self.steps[i], self.step_time[i] = step, step_time
        self.active[i] = np.nan if active is None else active
        for k in self.kinds:
            self.values[k][i] = group_values(self.g, k, per_source[SOURCE[k]])
        self.n += 1

    def last(self, k: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The last ``k`` rows: their steps, their step times, each kind's values."""
        k = min(k, self.n, self.cap)
        idx = np.arange(self.n - k, self.n) % self.cap
        return (self.steps[idx], self.step_time[idx].copy(),
                {kind: v[idx] for kind, v in self.values.items()})

    def last_active(self, k: int) -> np.ndarray:
        """``[k, world]``: the last ``k`` rows' ``active`` vectors (NaN where not given)."""
        k = min(k, self.n, self.cap)
        return self.active[np.arange(self.n - k, self.n) % self.cap]


def _leave_one_out_median(v: np.ndarray, stages: int) -> np.ndarray:
    """``[rows, groups]`` (stage-major) → per row and group, the median of the other groups of
    the same stage in that row. One sort per stage: removing the value at sorted position ``i``
    shifts the order statistics at and above ``i`` down by one, so the median of the rest is
    read off the sorted values (192 DP replicas a stage at 12,288 ranks: no [k, k-1] copy)."""
    rows, n = v.shape
    k = n // stages
    per = v.reshape(rows, stages, k)
    order = np.argsort(per, axis=-1)
    s = np.take_along_axis(per, order, axis=-1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(k), axis=-1)  # each group's place in the sort
    lo, hi = (k - 2) // 2, (k - 1) // 2  # the median's order statistics among k - 1 values

    def stat(j: int) -> np.ndarray:
        below = np.take(s, j, axis=-1)[..., None]
        above = np.take(s, min(j + 1, k - 1), axis=-1)[..., None]
        return np.where(j < pos, below, above)

    return ((stat(lo) + stat(hi)) / 2).reshape(rows, n)


def _row_excess(v: np.ndarray, stages: int) -> np.ndarray:
    """``[rows, groups]``: each group's value minus its stage's other groups', row by row."""
    return v - _leave_one_out_median(v, stages)


class LinkRules:
    """Judges the link rows (module docstring)."""

    def __init__(self, grid: Grid, config: WatchConfig):
        self.g, self.cfg = grid, config

    def slow_groups(self, rows: dict[str, np.ndarray], step_s: float) -> list[dict]:
        """Every slow group: kind, index, members, excess, its peers' value, the bar."""
        out = []
        for kind, v in rows.items():
            peers = _leave_one_out_median(v, blocks(self.g, kind))
            excess = np.quantile(v - peers, PERSIST_QUANTILE, axis=0)
            typical = median(peers, axis=0)
            n = len(excess)
            sigma = float(robust_sigma(excess)) if n >= MIN_PEERS else 0.0
            # each group needs a small floor; the node needs the full one (`judge`), since a
            # slow link shows in several kinds at once, each a share of what it costs
            bar = max(self.cfg.z_threshold * sigma, 0.25 * self.cfg.min_excess_frac * step_s)
            slow = (excess > bar) & (excess > (self.cfg.link_min_ratio - 1) * typical)
            members = group_members(self.g, kind)
            for j in np.flatnonzero(slow):
                out.append({"kind": kind, "group": int(j), "ranks": members[j].tolist(),
                            "excess_s": float(excess[j]), "peers_s": float(typical[j]),
                            "threshold_s": bar})
        return out

    def _saving(self, slow: list[dict], own: np.ndarray | None, whatif: WhatIf | None) -> float:
        """Seconds a step would save with every slow group as fast as its peers. A TP group's
        collectives sit inside its stage's forward and backward, so their excess goes through
        the pipeline model as busy time of the group's ranks (`WhatIf`); the DP reduction ends
        the step, so the slowest group's excess is saved whole."""
        # the DP reduction and the pipeline transfers are waited for whole
        dp = max((s["excess_s"] for s in slow if s["kind"] != "tp"), default=0.0)
        tp = [s for s in slow if s["kind"] == "tp"]
        if not tp:
            return dp
        if own is None or whatif is None or len(own) == 0:
            return dp + max(s["excess_s"] for s in tp)
        slowed = own.copy()
        for s in tp:
            slowed[:, s["ranks"]] += s["excess_s"]
        grid, m = whatif.grid, whatif.micro_batches
        return dp + max(0.0, float(median(model_step(slowed, grid, m) - model_step(own, grid, m))))

    def onset(self, steps: np.ndarray, rows: dict[str, np.ndarray], slow: list[dict]) -> int:
        """The first step of the stretch in which most of the slow groups were over their bar
        (detect/onset.py): the window reaches back before the link degraded."""
        excess = {kind: _row_excess(v, blocks(self.g, kind)) for kind, v in rows.items()}
        over = np.mean([excess[s["kind"]][:, s["group"]] > s["threshold_s"] for s in slow],
                       axis=0)
        return onset_step(steps, over >= 0.5)

    def cost(self, steps: np.ndarray, times: np.ndarray, rows: dict[str, np.ndarray],
             slow: list[dict], onset: int) -> tuple[list[dict], float, int]:
        """The slow groups with their excess measured on the rows from ``onset`` on (the
        median there: every such row is slow), the median step time of those rows, and how many
        rows that is. The window's rows before the onset were healthy: counting them would
        price the link at a fraction of its cost (module docstring, 4)."""
        after = steps >= onset
        if not after.any():
            after = np.ones(len(steps), bool)
        excess = {kind: _row_excess(v[after], blocks(self.g, kind))
                  for kind, v in rows.items()}
        priced = [{**s, "excess_s": float(median(excess[s["kind"]][:, s["group"]])),
                   "persist_excess_s": s["excess_s"]} for s in slow]
        return priced, float(median(times[after])), int(after.sum())

    def judge(self, link_rows: LinkRows, own: np.ndarray | None = None,
              whatif: WhatIf | None = None) -> list[Finding]:
        """Findings over the last ``persist_steps`` rows (none before there are that many).
        ``own``: ``[n, world]`` busy seconds of recent judged rows and ``whatif`` their step
        model, for the saving (`_saving`)."""
        if link_rows.n < self.cfg.persist_steps or not link_rows.kinds:
            return []
        steps, times, rows = link_rows.last(self.cfg.persist_steps)
        step_s = float(median(times))
        slow = self.slow_groups(rows, step_s)
        g = self.g
        gone = explained_pairs(g, slow, link_rows.last_active(self.cfg.persist_steps))
        slow = [s for s in slow if id(s) not in gone]
        common = _suspects(g, slow)
        if not common:
            return []  # two faults, or none shared by every slow group: nobody to suspect
        slow = [s for s in slow if common <= set(g.node[s["ranks"]].tolist())]
        # dp and dpx read the same reduction: one share, not two
        strength = sum(max(s["excess_s"] for s in slow if SOURCE[s["kind"]] == k)
                       for k in {SOURCE[s["kind"]] for s in slow})
        if strength < self.cfg.min_excess_frac * step_s:
            return []
        first = self.onset(steps, rows, slow)
        slow, step_s, priced_rows = self.cost(steps, times, rows, slow, first)
        pct, saved = WhatIf.from_saving(self._saving(slow, own, whatif), step_s)
        if pct < self.cfg.min_slowdown_pct:
            return []
        suspects = sorted(common)
        evidence = {"window_steps": [int(steps[0]), int(steps[-1])], "step_s": step_s,
                    "rule": "every group slower than its peer groups of the same kind "
                            "(smallest member time: the transfer) shares this node",
                    "slow_groups": slow, "saved_s": saved,
                    "priced_steps": [first, int(steps[-1])], "priced_rows": priced_rows,
                    "decided_by": f"{_groups_text(slow)}, over {len(steps)} judged steps (its "
                                  f"cost over the {priced_rows} from step {first} on)"}
        worst = max(slow, key=lambda s: s["excess_s"])
        more = f" and {len(slow) - 1} more group(s), all through it" if len(slow) > 1 else ""
        why = (f"its {LABEL[worst['kind']]} of ranks {worst['ranks']} is "
               f"{worst['excess_s']:.3g} s a step slower than its peers{more}")
        span = dict(first_step=first, last_step=int(steps[-1]), slowdown_pct=pct)
        if len(suspects) > 1:
            return [_suspects_finding(g, suspects, why, pct, evidence, span)]
        node = suspects[0]
        through = sorted({r for s in slow for r in s["ranks"]})
        evidence["ranks_in_slow_groups"] = [r for r in through if g.node[r] == node]
        name = g.name(node)
        return [Finding(kind="straggler", severity="warning", cause="slow_link",
                        message=f"node {name}: slow link ({why}); the job is {pct:.0f}% slower "
                                f"because of it",
                        ranks=g.node_ranks(node), nodes=[name], evidence=evidence, **span,
                        advice=f"checkpoint, then take {name} out of the job (quarantine) and "
                               f"check its NIC and cabling (mscale preflight on it)")]


def explained_pairs(g: Grid, slow: list[dict], active: np.ndarray) -> set[int]:
    """The ``id`` of each slow pipeline pair that a late rank of its pipeline explains. Both
    ends of a pair wait on the rest of their pipeline, and the two ends of a boundary wait in
    different phases (the later stage in the warm-up, the earlier in the cool-down), so a slow
    device, a data straggler or untraced host work at either end or two stages away raises the
    pair's smallest wait too. The rank at fault spends longer on its own work (``active``: its
    step less its waits) than its stage's peers. Left in, such pairs agreed with a stage that
    reduces more bytes than the others (embedding and head on the end stages: ``dpx``) and named
    a healthy node of that stage. A degraded NIC lengthens waits only, so its pairs stay."""
    out: set[int] = set()
    pairs = [s for s in slow if s["kind"] == "pp"]
    if not pairs or not np.isfinite(active).all():
        return out
    # each rank's active time above its stage's others' median (leave-one-out: of two ranks a
    # stage, a plain median would halve it), in half the rows or more
    late = median(_row_excess(active, g.pp), axis=0).reshape(g.pp, g.dp, g.tp)
    for s in pairs:
        replica = int(s["ranks"][0]) % (g.dp * g.tp) // g.tp
        if late[:, replica].max() >= 0.5 * s["excess_s"]:
            out.add(id(s))
    return out


def _suspects(g: Grid, slow: list[dict]) -> set[int]:
    """The nodes the slow link may be on. A TP or DP group slower than its own stage's peers is
    evidence enough: the link is on a node every such group holds. The other kinds only narrow:
    a pipeline pair alone is no link (a slow device raises its whole pipeline's waits, and in a
    synchronous job the other pipelines' too), nor are DP groups slower than other stages'
    alone (a stage with more layers reduces more bytes). So a secondary kind's nodes (those in
    every slow group of that kind) cut the suspects only where they keep one, and without
    primary evidence both secondary kinds must agree on a node."""
    shared = {}
    for kind in {s["kind"] for s in slow}:
        shared[kind] = set.intersection(*[set(g.node[s["ranks"]].tolist()) for s in slow
                                          if s["kind"] == kind])
    primary = [shared[k] for k in ("tp", "dp") if k in shared]
    secondary = [shared[k] for k in ("dpx", "pp") if k in shared]
    if primary:
        out = set.intersection(*primary)
    elif len(secondary) == 2:
        out = secondary.pop(0)
    else:
        return set()
    for nodes in secondary:
        narrowed = out & nodes
        if narrowed:
            out = narrowed
        elif not primary:
            return set()
    return out


def _groups_text(slow: list[dict]) -> str:
    return ", ".join(f"{LABEL[s['kind']]} of ranks {s['ranks']} {s['excess_s']:.3g} s above "
                     f"its peers' {s['peers_s']:.3g} s" for s in slow)


def _suspects_finding(g: Grid, suspects: list[int], why: str, pct: float, evidence: dict,
                      span: dict) -> Finding:
    """Every slow group runs through each of several nodes (a DP group over two nodes, a
    pipeline pair): the link is one of theirs, and these records cannot say which. Naming one
    would send a healthy node out of the job half the time, so no node is named (nothing is
    quarantined) and the operator is told how to separate them: preflight measures each link on
    its own and names a node whose links are slow against the others, which needs most of the
    links it measures to avoid that node (a ring of four nodes or more: over two or three, the
    slow links are the majority and pass as the norm; measured, docs/watch.md)."""
    names = [g.name(n) for n in suspects]
    listed = ", ".join(names)
    evidence = {**evidence, "suspects": names,
                "rule": "every slow group shares each of these nodes: the records cannot tell "
                        "which one's link is slow"}
    return Finding(kind="straggler", severity="warning", cause="slow_link", evidence=evidence,
                   message=f"slow link on one of {listed} ({why}); the job is {pct:.0f}% slower "
                           f"because of it; no node is named: every slow group runs through "
                           f"each of them", **span,
                   advice=f"checkpoint and stop the job, then run `mscale preflight` with a "
                          f"plan over {listed} and at least two more nodes, its DP groups "
                          f"across all of them (TP inside a node, pp 1): it measures each link "
                          f"between two nodes alone and names the node whose links are slow "
                          f"(over fewer nodes most links touch that node, and it cannot); "
                          f"exclude that node and relaunch")
