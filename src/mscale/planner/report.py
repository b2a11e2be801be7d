"""Human and machine output of a search: the ranked table, the rejections, the JSON document."""

from __future__ import annotations

from rich.table import Table

from mscale.config.layout import LayoutConfig
from mscale.planner.cost import LayoutCost, Problem
from mscale.planner.search import Rejects, SearchResult, describe

LOSS_COLUMNS = ("kernels", "recompute", "imbalance", "bubble", "tp", "pp", "dp")


def ranked(result: SearchResult, top: int) -> list[tuple[LayoutConfig, LayoutCost]]:
    """The best ``top`` layouts with their costs."""
    return [(result.layout(i), result.cost(i)) for i in range(min(top, result.count))]


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def layout_table(pb: Problem, rows: list[tuple[str, LayoutConfig, LayoutCost]]) -> Table:
    """One row per layout: the layout, memory of the fullest rank, step time, throughput, MFU."""
    t = Table(title=f"{pb.model.name} on {pb.cluster.world_size} × {pb.cluster.gpu.name} "
                    f"(dense peak {pb.cluster.gpu.peak_tflops:g} TFLOP/s), "
                    f"global batch {pb.training.global_batch}")
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("layout", no_wrap=True)
    for col in ("mem GB", "step s", "tok/s", "MFU %"):
        t.add_column(col, justify="right", no_wrap=True)
    for label, lo, c in rows:
        mem = f"{c.mem_total / 1e9:.3g}" + ("" if c.fits else " OOM")
        t.add_row(label, describe(lo), mem, f"{c.step_time:.3g}", _si(c.tokens_per_s),
                  _pct(c.mfu))
    return t


def losses_table(rows: list[tuple[str, LayoutConfig, LayoutCost]]) -> Table:
    """Where the rest of the peak goes, in % of peak; each row adds up to 100 with MFU."""
    t = Table(title="utilization lost, % of peak (kernels below peak, recompute, stage imbalance, "
                    "pipeline bubble, exposed TP / PP / DP communication)")
    t.add_column("#", justify="right")
    t.add_column("MFU", justify="right")
    for col in LOSS_COLUMNS:
        t.add_column(col, justify="right")
    for label, _, c in rows:
        lost = c.losses()
        t.add_row(label, _pct(c.mfu), *(_pct(lost[k]) for k in LOSS_COLUMNS))
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
    for reason, n, ex in rejects.rows():
        t.add_row(f"{n:,}", reason, ex)
    return t


def layout_record(lo: LayoutConfig, c: LayoutCost) -> dict:
    """A layout and its full cost as JSON-ready data."""
    return {"layout": lo.model_dump(mode="json", exclude_none=True), "cost": c.as_dict()}


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
        "top": [layout_record(lo, c) for lo, c in ranked(result, top)],
        "given": layout_record(*given) if given else None,
        "plan": plan,
    }
    if explain:
        doc["rejected"] = [{"reason": r, "count": n, "example": ex}
                           for r, n, ex in result.rejects.rows()]
    return doc
