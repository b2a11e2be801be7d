"""The layout search: enumerate every valid layout, cost them all at once, rank, and say why the
others were rejected.

Enumeration is two-level for speed: the (tp, pp, vpp, micro-batch) skeletons are checked in Python
(a few thousand at 12,288 GPUs), then each valid skeleton is expanded over sequence parallel,
recompute, ZeRO stage and DP reduction as numpy arrays and costed in one vectorised call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from mscale.config.layout import LayoutConfig, even_split
from mscale.errors import MscaleError
from mscale.planner.constants import MAX_MICRO_BATCH, MAX_SKELETONS, MODEL_ERROR
from mscale.planner.cost import (LAYER_COUNT_KEYS, LayerCounts, LayoutCost, Problem, cost_at,
                                 counts_of, evaluate_arrays, rank_layer_counts)
from mscale.planner.memory import RECOMPUTE_CODES

RECOMPUTE_NAMES = {v: k for k, v in RECOMPUTE_CODES.items()}
ZERO_AT_DP1 = ("z{z} at dp1: one replica, nothing to shard: runs and is priced as ZeRO 0 "
               "(training.zero_stage is kept; it shards wherever dp > 1)")
"""The note shown under the ranking when a listed layout has ZeRO > 0 at dp 1 (only a training
file's zero_stage puts one there: the search drops it otherwise, ZeRO 0 being the same)."""
UNEVEN_CHUNK_BLOCKS = (1, 2, 3, 4, 5, 6, 8)
"""Largest virtual-stage sizes (blocks) tried for uneven interleaving: published interleaved
runs use 1-4 blocks per virtual stage (MegaScale: 530B with 1; Korthikanti et al.: 175B with 4,
530B with 1-2); beyond 8 the bubble gain of interleaving is small."""
MAX_UNEVEN_STAGES = 4096
"""Most virtual stages of an uneven split the search builds (each is a list entry): ~20× the
deepest published pipeline, and it keeps a search within its time budget at any layer count."""


@dataclass
class Rejects:
    """Rejected layouts grouped by reason: count and one example per reason."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, example: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.setdefault(reason, example)

    def rows(self) -> list[tuple[str, int, str]]:
        return sorted(((r, n, self.examples[r]) for r, n in self.counts.items()),
                      key=lambda x: -x[1])


@dataclass
class SearchResult:
    """Every feasible layout's cost, best first, and the grouped rejections."""

    problem: Problem
    arrays: dict[str, np.ndarray]
    costs: dict[str, np.ndarray]
    rejects: Rejects
    closest: int | None = None
    """Index (into arrays) of the least-memory layout when none fits, else None."""
    examined: int = 0
    count: int = 0
    """Layouts that fit, ranked first in ``arrays``/``costs`` (the rest are the misfits)."""
    preferred_note: str = ""
    """Why the first layout is not the fastest one, when a simpler one within MODEL_ERROR of it
    was moved ahead; empty when the fastest is also the simplest."""

    def layout(self, i: int) -> LayoutConfig:
        return layout_at(self.arrays, i, self.problem.model.layers)

    def cost(self, i: int) -> LayoutCost:
        return cost_at(self.costs, i)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order, in O(√n)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def tp_candidates(pb: Problem, rejects: Rejects) -> list[int]:
    """TP sizes inside one fast domain that divide heads, kv heads, MLP width and vocabulary."""
    m = pb.model
    out = []
    for tp in divisors(pb.cluster.domain_size):
        for what, n in (("heads", m.heads), ("kv_heads", m.num_kv_heads), ("ffn", m.ffn),
                        ("vocab", m.vocab)):
            if n % tp:
                rejects.add(f"tp does not divide {what}", f"tp={tp}, {what}={n}")
                break
        else:
            out.append(tp)
    return out


def interleavings(layers: int, pp: int) -> list[int]:
    """Virtual stages per rank v > 1: even splits (pp·v divides the layers, any v) and uneven ones.

    The engine runs uneven splits (`LayoutConfig.stage_layers`, parallel/pipeline/stages.py), so
    126 layers are searchable at any pp. For each size c in UNEVEN_CHUNK_BLOCKS of the largest
    virtual stage the fewest virtual stages giving it, v = ⌈layers/(pp·c)⌉, is tried (more
    stages of the same largest size add transfers without shortening the slowest rank), while
    pp·v stays within MAX_UNEVEN_STAGES (an uneven split is spelled out stage by stage).
    """
    if pp == 1:
        return []
    out = set(divisors(layers // pp)) if layers % pp == 0 else set()
    for c in UNEVEN_CHUNK_BLOCKS:
        v = -(-layers // (pp * c))
        if pp * v <= MAX_UNEVEN_STAGES:
            out.add(v)
    # up to two stages more than blocks: the first and last may hold only the embedding / head
    return sorted(v for v in out if v > 1 and pp * v <= layers + 2)


def light_split(layers: int, pp: int, vpp: int) -> list[int] | None:
    """Stage split with the first and last virtual stages one block lighter (they carry the
    embedding and the head and loss; Llama 3 §3.3.2 removes one layer from each for this, so
    that with one-block virtual stages the first holds only the embedding and the last only the
    head), or None when that is not a split or is the default split already. With more stages
    than blocks (at most two more) it is the only split the search tries."""
    stages = pp * vpp
    if pp == 1 or layers + 2 < stages or stages > MAX_UNEVEN_STAGES:
        return None
    split = even_split(layers + 2, stages)
    split[0] -= 1
    split[-1] -= 1
    if min(split) < 0 or (stages <= layers and split == even_split(layers, stages)):
        return None  # not a split, or the default one (searched as such)
    return split


@functools.lru_cache(maxsize=4096)
def light_counts(layers: int, pp: int, vpp: int) -> LayerCounts | None:
    """`LayerCounts` of `light_split`, or None. Cached: the search asks for the same (pp, vpp)
    once per micro-batch size and once per skeleton."""
    split = light_split(layers, pp, vpp)
    if split is None:
        return None
    return counts_of([sum(split[r::pp]) for r in range(pp)])


def skeletons(pb: Problem, rejects: Rejects) -> list[tuple[int, int, int, int, int, int]]:
    """Valid (tp, pp, vpp, dp, micro_batch, light) tuples; the rest go to ``rejects``. ``light``
    marks the variant whose first and last virtual stages carry one block less (`light_split`).

    Raises MscaleError rather than build more than MAX_SKELETONS of them, so that no input can
    keep the planner busy for minutes (each one is later crossed with up to 36 option sets).
    """
    tr, layers, world = pb.training, pb.model.layers, pb.cluster.world_size
    mbs = [tr.micro_batch] if tr.micro_batch else range(1, MAX_MICRO_BATCH + 1)
    out: list[tuple[int, int, int, int, int, int]] = []
    for tp in tp_candidates(pb, rejects):
        for pp in divisors(world // tp):
            if pp > layers:
                continue  # not a layout at all: fewer blocks than stages
            if pp > 1 and pb.model.tie_embeddings:
                rejects.add("tied embeddings need pp = 1 (the engine keeps one copy)",
                            f"tp={tp} pp={pp}")
                continue
            dp = world // (tp * pp)
            vs = interleavings(layers, pp)
            has_light = {v for v in [1, *vs] if light_counts(layers, pp, v) is not None}
            for mb in mbs:
                if tr.global_batch % (dp * mb):
                    rejects.add("global_batch not divisible by dp·micro_batch",
                                f"tp={tp} pp={pp} dp={dp} mb={mb}")
                    continue
                m = tr.global_batch // (dp * mb)
                if pp > 1 and m < pp:
                    rejects.add("fewer micro-batches than pipeline stages",
                                f"tp={tp} pp={pp} dp={dp} mb={mb}: m={m}")
                    continue
                _reject_interleavings(layers, tp, pp, m, vs, rejects)
                ok = [1] + (vs if m % pp == 0 else [])
                if len(out) + len(ok) > MAX_SKELETONS:
                    raise _too_large(pb)
                lights = [v for v in ok if v in has_light]
                ok = [v for v in ok if pp * v <= layers]  # more stages: only as light ends
                if len(out) + len(ok) + len(lights) > MAX_SKELETONS:
                    raise _too_large(pb)
                out.extend((tp, pp, v, dp, mb, 0) for v in ok)
                out.extend((tp, pp, v, dp, mb, 1) for v in lights)
    return out


def _reject_interleavings(layers: int, tp: int, pp: int, m: int, vs: list[int],
                          rejects: Rejects) -> None:
    """Count the interleavings the micro-batch count rules out (the engine's schedule needs m
    divisible by pp with v > 1)."""
    if vs and m % pp:
        rejects.add("interleaving needs micro-batches divisible by pp",
                    f"tp={tp} pp={pp} vpp={vs[0]} m={m}", n=len(vs))


def _too_large(pb: Problem) -> MscaleError:
    return MscaleError(
        f"more than {MAX_SKELETONS:,} (tp, pp, vpp, micro-batch) combinations to search for "
        f"{pb.model.layers:,} layers on {pb.cluster.world_size:,} GPUs",
        field="micro_batch", fix="set training.micro_batch (and zero_stage, recompute) to narrow "
                                 "the search, or check model.layers and cluster.nodes")


def expand(pb: Problem, sk: list[tuple[int, int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """Cross every skeleton with SP × recompute × ZeRO × DP reduction (restricted by training)."""
    tr, gpn = pb.training, pb.cluster.gpus_per_node
    recs = [RECOMPUTE_CODES[tr.recompute]] if tr.recompute else [0, 1, 2]
    stack = pb.stack_profile  # only what the priced stack offers (a training file may insist)
    zeros = [tr.zero_stage] if tr.zero_stage is not None else list(stack.zero_stages)
    hiers = (0, 1) if stack.hierarchical_dp else (0,)
    opts = np.array([(sp, r, z, h) for sp in (0, 1) for r in recs for z in zeros for h in hiers])
    layers = pb.model.layers
    counts = [light_counts(layers, pp, vpp) if light else rank_layer_counts(layers, pp, vpp)
              for _, pp, vpp, _, _, light in sk]
    base = np.hstack([np.array(sk, dtype=np.int64).reshape(-1, 6),
                      np.array(counts, dtype=np.int64).reshape(-1, len(LAYER_COUNT_KEYS))])
    nb, no = len(base), len(opts)
    b = np.repeat(base, no, axis=0)
    o = np.tile(opts, (nb, 1))
    names = ("tp", "pp", "vpp", "dp", "mb", "light", *LAYER_COUNT_KEYS)
    arr = {k: b[:, i] for i, k in enumerate(names)}
    arr.update(sp=o[:, 0].astype(bool), rec=o[:, 1], zero=o[:, 2], hier=o[:, 3].astype(bool))
    # drop options that change nothing: SP without TP, ZeRO without DP, hierarchical without
    # several DP members per node or several nodes. Each is dropped only where its equivalent
    # (SP off, ZeRO 0, flat) is searched too: a training file's zero_stage 1 or 2 is kept at
    # dp 1, where the engine runs it as ZeRO 0 (nothing to shard over; parallel/buckets.py
    # BufferMode.of) and the cost model prices it so (`ZERO_AT_DP1`), instead of leaving no
    # layout at all on a cluster where only dp 1 is possible.
    k = np.minimum(np.maximum(gpn // arr["tp"], 1), arr["dp"])
    keep = ~(arr["sp"] & (arr["tp"] == 1))
    if 0 in zeros:
        keep &= ~((arr["zero"] > 0) & (arr["dp"] == 1))
    keep &= ~(arr["hier"] & ((k == 1) | (arr["dp"] // k <= 1)))
    if pb.model.seq_len:
        keep &= ~(arr["sp"] & (pb.model.seq_len % arr["tp"] != 0))
    return {key: v[keep] for key, v in arr.items()}


def search(pb: Problem) -> SearchResult:
    """Enumerate, cost and rank every layout of ``pb``; feasible ones first by step time."""
    rejects = Rejects()
    sk = skeletons(pb, rejects)
    if not sk:
        return SearchResult(pb, {}, {}, rejects)
    arr = expand(pb, sk)
    if not len(arr["tp"]):  # cannot happen (expand keeps an equivalent of what it drops); if
        # it did, no_fit_error's "no valid layout" path says so, never argmin of nothing
        tp, pp, _, dp, mb, _ = sk[0]
        rejects.add("every option set dropped as redundant (a planner bug)",
                    f"tp={tp} pp={pp} dp={dp} mb={mb}", n=len(sk))
        return SearchResult(pb, {}, {}, rejects)
    costs = evaluate_arrays(pb, arr)
    fits = costs["fits"]
    examined = len(fits)
    if not fits.any():
        closest = int(np.argmin(costs["mem_total"]))
        _reject_memory(pb, arr, costs, ~fits, rejects)
        return SearchResult(pb, arr, costs, rejects, closest=closest, examined=examined)
    _reject_memory(pb, arr, costs, ~fits, rejects)
    order = np.lexsort((costs["mem_total"], costs["step_time"]))
    order = order[fits[order]]
    order, note = _prefer_simpler(pb, arr, costs, order)
    arr = {k: v[order] for k, v in arr.items()}
    costs = {k: (v[order] if np.ndim(v) else v) for k, v in costs.items()}
    return SearchResult(pb, arr, costs, rejects, examined=examined, count=int(fits.sum()),
                        preferred_note=note)


def _prefer_simpler(pb: Problem, arr, costs, order: np.ndarray) -> tuple[np.ndarray, str]:
    """Move the simplest layout within MODEL_ERROR of the fastest to the front.

    The model cannot tell apart layouts whose predicted step times differ by less than its own
    error, and the simpler one carries less risk: fewer virtual stages (fewer chunk runs, fewer
    p2p transfers, less activation memory in flight), then fewer transfers per step, then the
    even split. The rest stay in order of predicted time.
    """
    step = costs["step_time"][order]
    band = order[step <= step[0] * (1 + MODEL_ERROR)]
    micro = costs["micro_batches"][band]
    transfers = np.where(arr["pp"][band] > 1, 2 * arr["vpp"][band] * micro, 0)
    keys = (costs["step_time"][band], arr["light"][band], transfers, arr["vpp"][band])
    pick = band[np.lexsort(keys)[0]]
    if pick == order[0]:
        return order, ""
    fast, slow = order[0], pick
    gap = costs["step_time"][slow] / costs["step_time"][fast] - 1
    why = []
    v_fast, v_slow = int(arr["vpp"][fast]), int(arr["vpp"][slow])
    if v_slow != v_fast:
        why.append(f"v{v_slow} instead of v{v_fast}")
    t_fast, t_slow = (int(2 * arr["vpp"][i] * costs["micro_batches"][i]) for i in (fast, slow))
    if t_slow != t_fast:
        why.append(f"{t_slow} instead of {t_fast} transfers per rank per step")
    if arr["light"][fast] and not arr["light"][slow]:
        why.append("the default split instead of lighter first and last stages")
    if not why:  # a tie in time and simplicity: keep the ranking
        return order, ""
    layers = pb.model.layers
    note = (f"{describe(layout_at(arr, int(slow), layers))} is ranked first: {100 * gap:.1f}% "
            f"slower than the fastest ({describe(layout_at(arr, int(fast), layers))}), within the "
            f"model's {100 * MODEL_ERROR:.0f}% error, and simpler: {', '.join(why)}")
    return np.concatenate([[pick], order[order != pick]]), note


def _reject_memory(pb: Problem, arr, costs, bad, rejects: Rejects) -> None:
    """Group out-of-memory layouts by (recompute, ZeRO) with the least memory each needs."""
    gb = pb.budget_bytes / 1e9
    for r in np.unique(arr["rec"][bad]) if bad.any() else []:
        for z in np.unique(arr["zero"][bad & (arr["rec"] == r)]):
            sel = np.flatnonzero(bad & (arr["rec"] == r) & (arr["zero"] == z))
            i = sel[np.argmin(costs["mem_total"][sel])]
            reason = (f"out of memory (> {gb:.1f} GB usable) with recompute={RECOMPUTE_NAMES[int(r)]}"
                      f", zero={int(z)}")
            rejects.add(reason, f"least needs {_gb_over(costs['mem_total'][i] / 1e9, gb)} GB: "
                        f"{describe(layout_at(arr, int(i), pb.model.layers))}", n=len(sel))


def _gb_over(need: float, budget: float) -> str:
    """``need`` rounded up, with as many decimals as it takes to read above ``budget`` (72.04
    > 72.0, not "needs 72.0 GB" against "> 72.0 GB usable")."""
    for digits in (1, 2, 3):
        up = math.ceil(need * 10**digits) / 10**digits
        if up > budget:
            return f"{up:.{digits}f}"
    return f"{need:.3f}"


def layout_at(arr: dict[str, np.ndarray], i: int, layers: int) -> LayoutConfig:
    """The LayoutConfig of candidate ``i`` (a light-ends split spelled out in stage_layers)."""
    pp, vpp = int(arr["pp"][i]), int(arr["vpp"][i])
    light = bool(arr["light"][i]) if "light" in arr else False
    return LayoutConfig(tp=int(arr["tp"][i]), pp=pp, dp=int(arr["dp"][i]),
                        stage_layers=light_split(layers, pp, vpp) if light else None,
                        vpp=int(arr["vpp"][i]), sequence_parallel=bool(arr["sp"][i]),
                        micro_batch=int(arr["mb"][i]), zero_stage=int(arr["zero"][i]),
                        recompute=RECOMPUTE_NAMES[int(arr["rec"][i])],
                        dp_reduce="hierarchical" if arr["hier"][i] else "flat")


def describe(lo: LayoutConfig) -> str:
    """A layout in one short line, as the tables and messages show it."""
    parts = [f"tp{lo.tp} pp{lo.pp}", f"v{lo.vpp}" if lo.vpp > 1 else "",
             "split " + "/".join(map(str, _ends(lo.stage_layers))) if lo.stage_layers else "",
             f"dp{lo.dp}",
             f"mb{lo.micro_batch}", "sp" if lo.sequence_parallel else "",
             {"none": "", "selective": "sel", "full": "full"}[lo.recompute], f"z{lo.zero_stage}",
             "hier" if lo.dp_reduce == "hierarchical" else ""]
    return " ".join(p for p in parts if p)


def _ends(split: list[int]) -> list[int]:
    """First, second and last stage sizes of a split, enough to tell a light-ends one."""
    return [split[0], split[1], split[-1]] if len(split) > 2 else list(split)
