"""Human and machine output of a search: the ranked table, the rejections, the JSON document."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.table import Table

from mscale.config.layout import LayoutConfig
from mscale.planner.cost import LayoutCost, Problem
from mscale.planner.search import ZERO_AT_DP1, Rejects, SearchResult, describe

LOSS_COLUMNS = ("kernels", "recompute", "imbalance", "bubble", "tp", "pp", "dp")
EQUAL_COST_RTOL = 1e-12
"""Relative gap in step time and in memory below which two layouts count as one cost. The model
prices some options identically (ZeRO 1 and 2 on this engine, whose gradient buffer lives through
every backward, so the peak is the same; a light-ends split whose slowest rank holds as many blocks
as the even one's; a DP reduction hidden either way): bit-equal, or apart by float rounding
(~1e-15) were the sums ever taken in another order. The smallest real gap on the example configs
is 6e-9 (530B on 11,200 A100s, megascale stack; 2026-12-01), so layouts the model tells apart stay
apart even where the table's three digits round them alike."""
VARIANT_FIELDS = (("tp", "tp"), ("pp", "pp"), ("vpp", "v"), ("micro_batch", "mb"),
                  ("sequence_parallel", "sp"), ("recompute", "recompute"), ("zero_stage", "zero"),
                  ("dp_reduce", "dp reduce"), ("stage_layers", "split"))
"""Layout fields an equal-cost note compares, with their short names (dp follows from tp, pp)."""
SHORT = {"hierarchical": "hier", "selective": "sel"}
"""Values shortened as `search.describe` shortens them."""


@dataclass(frozen=True)
class Row:
    """One row of the ranking: a layout, its cost, and the other layouts of the same cost."""

    label: str
    layout: LayoutConfig
    cost: LayoutCost
    variants: tuple[LayoutConfig, ...] = ()
    """Layouts the model prices the same (EQUAL_COST_RTOL), in ranked order; ``layout`` is the
    first of its class in the ranking, so row 1 holds the layout `mscale plan -o` writes (unless
    --keep-given)."""

    @property
    def variant_note(self) -> str:
        """What the folded layouts differ in, e.g. ``+3: zero 1/2, split even/0-1-0``."""
        if not self.variants:
            return ""
        group = (self.layout, *self.variants)
        diffs = []
        for name, short in VARIANT_FIELDS:
            values = list(dict.fromkeys(_show(getattr(lo, name)) for lo in group))
            if len(values) > 1:
                diffs.append(f"{short} {'/'.join(values)}")
        return f"+{len(self.variants)}: {', '.join(diffs)}"


def _show(value) -> str:
    """A layout field's value as the equal-cost note writes it ("/" separates values)."""
    if value is None:
        return "even"  # stage_layers unset: the default split
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):  # a split, by its first, second and last stage
        return "-".join(map(str, value[:2] + value[-1:] if len(value) > 2 else value))
    return SHORT.get(value, str(value))


def distinct(result: SearchResult, top: int) -> list[Row]:
    """The best ``top`` cost classes, each as its first-ranked layout plus its equal-cost variants.

    Without folding, ``--top 5`` for 175B on 12,288 A100s showed one layout four times (ZeRO 1/2 ×
    even/light-ends split). The class's representative is the one the search ranks first, so row
    1 is `result.layout(0)`, the plan's layout; among exact ties the search keeps the order in
    which `search.expand` enumerates (even split before light ends, lower ZeRO stage first, flat
    before hierarchical DP reduction), so the simplest variant represents its class.
    """
    return [Row(str(n + 1), result.layout(int(g[0])), result.cost(int(g[0])),
                tuple(result.layout(int(i)) for i in g[1:]))
            for n, g in enumerate(_cost_classes(result, top))]


def _cost_classes(result: SearchResult, top: int) -> list[np.ndarray]:
    """Indices into the ranking of the first ``top`` classes of equal cost, each in ranked order.

    Greedy in ranked order: a layout not yet taken opens a class with every untaken layout whose
    step time and memory are within EQUAL_COST_RTOL of its own. A window on the sorted step times
    finds the candidates, so the cost is O(top · log n) plus the classes' sizes.
    """
    if result.count == 0:
        return []
    step = result.costs["step_time"][:result.count]
    mem = result.costs["mem_total"][:result.count]
    by_step = np.argsort(step, kind="stable")
    sorted_step = step[by_step]
    taken = np.zeros(len(step), dtype=bool)
    classes: list[np.ndarray] = []
    for i in range(len(step)):
        if len(classes) == top:
            break
        if taken[i]:
            continue
        lo = np.searchsorted(sorted_step, step[i] * (1 - EQUAL_COST_RTOL), side="left")
        hi = np.searchsorted(sorted_step, step[i] * (1 + EQUAL_COST_RTOL), side="right")
        near = np.sort(by_step[lo:hi])  # back to ranked order
        near = near[~taken[near] & (np.abs(mem[near] - mem[i]) <= EQUAL_COST_RTOL * mem[i])]
        taken[near] = True
        classes.append(near)
    return classes


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def layout_table(pb: Problem, rows: list[Row]) -> Table:
    """One row per layout: the layout, memory of the fullest rank, step time, throughput, MFU,
    and (when any row has them) the equal-cost layouts folded into it."""
    t = Table(title=f"{pb.model.name} on {pb.cluster.world_size} × {pb.cluster.gpu.name} "
                    f"(dense peak {pb.cluster.gpu.peak_tflops:g} TFLOP/s), "
                    f"global batch {pb.training.global_batch}")
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("layout", no_wrap=True)
    for col in ("mem GB", "step s", "tok/s", "MFU %"):
        t.add_column(col, justify="right", no_wrap=True)
    folded = any(r.variants for r in rows)
    if folded:
        t.add_column("equal cost", overflow="fold")  # narrow terminals: wrap, never crop
    for r in rows:
        c = r.cost
        mem = f"{c.mem_total / 1e9:.3g}" + ("" if c.fits else " OOM")
        cells = [r.label, describe(r.layout), mem, f"{c.step_time:.3g}", _si(c.tokens_per_s),
                 _pct(c.mfu)]
        t.add_row(*cells, *([r.variant_note] if folded else []))
    t.caption, t.caption_justify = zero_note(rows) or None, "left"
    return t


def zero_note(rows: list[Row]) -> str:
    """Why a row says z1 or z2 at dp1 (`search.ZERO_AT_DP1`); empty when none does."""
    stages = sorted({lo.zero_stage for r in rows for lo in (r.layout, *r.variants)
                     if lo.dp == 1 and lo.zero_stage > 0})
    return ZERO_AT_DP1.format(z="/".join(map(str, stages))) if stages else ""


def losses_table(rows: list[Row]) -> Table:
    """Where the rest of the peak goes, in % of peak; each row adds up to 100 with MFU."""
    t = Table(title="utilization lost, % of peak (kernels below peak, recompute, stage imbalance, "
                    "pipeline bubble, exposed TP / PP / DP communication)")
    t.add_column("#", justify="right")
    t.add_column("MFU", justify="right")
    for col in LOSS_COLUMNS:
        t.add_column(col, justify="right")
    for r in rows:
        lost = r.cost.losses()
        t.add_row(r.label, _pct(r.cost.mfu), *(_pct(lost[k]) for k in LOSS_COLUMNS))
    return t


def memory_table(c: LayoutCost) -> Table:
    """Memory of the fullest rank, term by term."""
    t = Table(title="memory per GPU (fullest pipeline rank)")
    t.add_column("term")
    t.add_column("GB", justify="right")
    for k in ("weights", "gradients", "optimizer", "activations", "logits", "total", "budget"):
        t.add_row(k, f"{getattr(c, f'mem_{k}') / 1e9:.3g}")
        if k == "activations" and c.mem_weight_copies:
            t.add_row("  of which bf16 weight copies", f"{c.mem_weight_copies / 1e9:.3g}")
    t.add_row("host pinned (not GPU)", f"{c.host_pinned / 1e9:.3g}")
    return t


def rejects_table(rejects: Rejects, examined: int) -> Table:
    """Rejected layouts grouped by reason, most common first, with one example each."""
    t = Table(title=f"rejected layouts ({examined} fully costed; structural rejects counted "
                    "before expansion)")
    t.add_column("count", justify="right")
    t.add_column("reason")
    t.add_column("example")
    rows = rejects.rows()
    for reason, n, ex in rows:
        t.add_row(f"{n:,}", reason, ex)
    if not rows:  # an empty table read as a failure to explain
        t.add_row("0", "none: every layout the search enumerated fits", "-")
    return t


def layout_record(lo: LayoutConfig, c: LayoutCost) -> dict:
    """A layout and its full cost as JSON-ready data."""
    return {"layout": lo.model_dump(mode="json", exclude_none=True), "cost": c.as_dict()}


def row_record(r: Row) -> dict:
    """A ranked row as JSON: its layout and cost, plus the equal-cost layouts folded into it
    (``variants``, in ranked order; empty when none) and what they differ in (``variants_note``,
    as the table's column, or null)."""
    return {**layout_record(r.layout, r.cost),
            "variants": [lo.model_dump(mode="json", exclude_none=True) for lo in r.variants],
            "variants_note": r.variant_note or None}


def json_document(result: SearchResult, top: int, given: tuple[LayoutConfig, LayoutCost] | None,
                  plan: dict | None, explain: bool) -> dict:
    """The single document `mscale plan --json` prints."""
    pb = result.problem
    doc = {
        "model": pb.model.name, "cluster": pb.cluster.name, "gpus": pb.cluster.world_size,
        "stack": pb.stack_profile.name,
        "calibration": pb.calibration.sources if pb.calibration is not None else None,
        "feasible": result.count, "examined": result.examined,
        "preferred_note": result.preferred_note or None,
        "top": [row_record(r) for r in distinct(result, top)],
        "given": layout_record(*given) if given else None,
        "plan": plan,
    }
    if explain:
        doc["rejected"] = [{"reason": r, "count": n, "example": ex}
                           for r, n, ex in result.rejects.rows()]
    return doc
