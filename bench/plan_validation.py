"""Check the planner against published training results: predicted vs published throughput for
each run's published layout, and whether the search ranks that layout among its top 3.

Why: the cost model's constants were fitted on one table (MegaScale's); only results from other
sources say whether its predictions hold for other models, GPUs and stacks. The dataset is
bench/data/published_runs.yaml (each run's source, model, cluster, layout and figure); this
script regenerates docs/plan-validation.md from it. Usage:

    .venv/bin/python bench/plan_validation.py              # writes docs/plan-validation.md
    .venv/bin/python bench/plan_validation.py --no-search  # errors only, printed, nothing written

The core, `validate`, is imported by tests/unit/planner/test_validation.py; the markdown comes
from bench/plan_validation_report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig, check_layout
from mscale.errors import MscaleError
from mscale.planner.cost import Problem, evaluate
from mscale.planner.search import describe, search

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling report module
from plan_validation_report import render, planner_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data" / "published_runs.yaml"
DOC = ROOT / "docs" / "plan-validation.md"
BASELINE = ROOT / "bench" / "data" / "plan_validation_baseline.json"
"""The summary before issue 13's cost-model changes, shown next to the current one."""
COMMAND = ".venv/bin/python bench/plan_validation.py"
KINDS = ("mfu", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "iteration_time_s")
LAYOUT_KEYS = ("tp", "pp", "vpp", "dp", "micro_batch", "sequence_parallel", "recompute",
               "zero_stage")
MATCH_KEYS = ("tp", "pp", "vpp", "micro_batch")
"""Fields compared when looking for the published layout in the search's ranking (when published)."""
DEFAULTS = {"vpp": 1, "micro_batch": 1, "sequence_parallel": False, "recompute": "none",
            "zero_stage": 0}
"""Last resort for a field neither published nor assumed by the run (the script says so)."""


@dataclass
class Result:
    """One run: the published figure, the prediction in the same unit, and the search's verdict."""

    run_id: str
    source: str
    fit: bool
    kind: str
    published: float
    predicted: float
    error: float
    """Relative error of predicted throughput: predicted/published − 1 (for a time, the inverse),
    so + means the planner is optimistic."""
    published_mfu: float
    predicted_mfu: float
    fits: bool
    """The evaluated layout (assumed fields included) fits the planner's memory model."""
    layout: str
    assumed: list[str] = field(default_factory=list)
    profile: str | None = None
    """The planner stack profile applied (None: the planner's default)."""
    fits_any: bool = False
    """Some choice of the unpublished memory options (recompute, ZeRO stage, SP) fits: the run
    happened, so False is the memory model's error, not the assumption's."""
    rank: int | None = None
    """1-based position of the published layout among the search's distinct feasible layouts
    (see `_distinct_rank`); None if absent."""
    top3: bool | None = None
    best: str = ""
    best_mfu: float | None = None
    tuned: str = ""
    """The search's best feasible layout keeping every published field (see `_best_completion`)."""
    tuned_error: float | None = None
    """Error of that layout's prediction, same sign convention as ``error``."""
    search_note: str = ""
    error_note: str = ""


def load(path: Path = DATA) -> dict:
    """The dataset, parsed with yaml.safe_load and checked for the fields the script needs."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise MscaleError("expected a mapping with 'sources' and a list of 'runs'", file=str(path),
                          fix="see the header of bench/data/published_runs.yaml")
    for run in data["runs"]:
        if run.get("source") not in data.get("sources", {}):
            raise MscaleError(f"run {run.get('id')!r} names an unknown source", file=str(path),
                              field="source", fix="add the source under 'sources'")
        if run.get("figure", {}).get("kind") not in KINDS:
            raise MscaleError(f"run {run.get('id')!r}: unknown figure kind", file=str(path),
                              field="figure.kind", fix=f"use one of {', '.join(KINDS)}")
    return data


def problem_for(data: dict, run: dict) -> Problem:
    """The planner's Problem for a run: its model, batch and the source's cluster at its GPU count."""
    src = data["sources"][run["source"]]
    m = run["model"]
    model = ModelConfig(name=run["id"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                        kv_heads=m.get("kv_heads"), ffn_hidden=m["ffn"], mlp=m["mlp"],
                        vocab=m["vocab"], seq_len=m["seq"])
    training = TrainingConfig(global_batch=run["global_batch"])
    cl = dict(src["cluster"])
    cl["nodes"] = run["gpus"] // cl.get("gpus_per_node", 8)
    profile = applied_profile(data, run)
    extra = {"stack": profile} if profile and "stack" in Problem.__dataclass_fields__ else {}
    return Problem(model, training, ClusterConfig(**cl), **extra)


def applied_profile(data: dict, run: dict) -> str | None:
    """The planner stack profile that prices the run: the run's (or its source's) `profile`,
    when the planner has stack profiles and knows that one; None otherwise (the planner's
    default then applies, and the table says so)."""
    name = run.get("profile", data["sources"][run["source"]].get("profile"))
    try:
        from mscale.planner.stacks import STACKS  # noqa: PLC0415 (absent before issue 13)
    except ImportError:
        return None
    return name if name in STACKS else None


def layout_for(run: dict) -> tuple[LayoutConfig, list[str]]:
    """The published layout, completed by the run's `assume` values; returns the names assumed."""
    pub, assume = run["layout"], run.get("assume", {})
    values, assumed = {}, []
    for key in LAYOUT_KEYS:
        if pub.get(key) is not None:
            values[key] = pub[key]
        elif key in assume:
            values[key], _ = assume[key], assumed.append(key)
        elif key in DEFAULTS:
            values[key], _ = DEFAULTS[key], assumed.append(key)
    return LayoutConfig(**values), assumed


def _convert(kind: str, value: float, cost, pb: Problem) -> tuple[float, float]:
    """(prediction in the published unit, the published figure as MFU). Hardware figures are
    turned into MFU with the planner's own model/hardware FLOP ratio for the layout."""
    peak = pb.cluster.gpu.peak_tflops
    ratio = cost.mfu / cost.hfu if cost.hfu else 1.0
    if kind == "mfu":
        return cost.mfu, value
    if kind == "model_tflops_per_gpu":
        return cost.mfu * peak, value / peak
    if kind == "hardware_tflops_per_gpu":
        return cost.hfu * peak, value / peak * ratio
    return cost.step_time, cost.mfu * cost.step_time / value  # iteration_time_s


def evaluate_run(data: dict, run: dict) -> Result:
    """Cost the run's published layout and compare with its figure (no search)."""
    pb = problem_for(data, run)
    layout, assumed = layout_for(run)
    check_layout(layout, pb.model, pb.training, pb.cluster, source=run["id"])
    cost = evaluate(pb, layout)
    kind, value = run["figure"]["kind"], float(run["figure"]["value"])
    predicted, pub_mfu = _convert(kind, value, cost, pb)
    error = value / predicted - 1 if kind == "iteration_time_s" else predicted / value - 1
    return Result(run["id"], run["source"], bool(run.get("fit")), kind, value, predicted, error,
                  pub_mfu, cost.mfu, cost.fits, describe(layout), assumed,
                  applied_profile(data, run), cost.fits or _fits_somehow(pb, run, layout))


def _fits_somehow(pb: Problem, run: dict, layout: LayoutConfig) -> bool:
    """Whether any value of the memory options the source leaves unpublished lets the layout fit."""
    pub = run["layout"]
    choices = {"recompute": ["none", "selective", "full"], "zero_stage": [0, 1, 2],
               "sequence_parallel": [False, True] if layout.tp > 1 else [False]}
    free = {k: v for k, v in choices.items() if pub.get(k) is None}
    for combo in itertools.product(*free.values()):
        alt = layout.model_copy(update=dict(zip(free, combo)))
        try:
            check_layout(alt, pb.model, pb.training, pb.cluster)
        except MscaleError:
            continue
        if evaluate(pb, alt).fits:
            return True
    return False


def rank_in_search(data: dict, run: dict, res: Result) -> None:
    """Run the search for the run's problem and record where its published layout ranks.

    The search is left free (micro-batch, recompute, ZeRO); when it refuses as too large, it is
    narrowed to the published (or assumed) micro-batch and the table says so.
    """
    pb = problem_for(data, run)
    layout, _ = layout_for(run)
    try:
        result = search(pb)
    except MscaleError:
        tr = pb.training.model_copy(update={"micro_batch": layout.micro_batch})
        pb = dataclasses.replace(pb, training=tr)
        result = search(pb)
        res.search_note = f"search narrowed to micro-batch {layout.micro_batch}"
    if not result.count:
        res.search_note = "no layout fits in the planner's memory model"
        res.top3 = False
        return
    want = {k: run["layout"][k] for k in MATCH_KEYS if run["layout"].get(k) is not None}
    res.best, res.best_mfu = describe(result.layout(0)), result.cost(0).mfu
    res.rank = _distinct_rank(result, want)
    res.top3 = res.rank is not None and res.rank <= 3
    i = _best_completion(result, run)
    if i is not None:
        predicted, _ = _convert(res.kind, res.published, result.cost(i), pb)
        res.tuned = describe(result.layout(i))
        res.tuned_error = (res.published / predicted - 1 if res.kind == "iteration_time_s"
                           else predicted / res.published - 1)


def _best_completion(result, run: dict) -> int | None:
    """Index of the search's best feasible layout that keeps every published field: the
    planner's prediction for the published run with its unpublished fields tuned, as their
    authors tuned them (Narayanan et al. §3 chose micro-batch sizes by measurement). An assumed
    recompute mode is kept too: it changes the work done (and what a hardware-FLOP figure
    counts), not how well a layout runs it."""
    pub = {k: v for k, v in run["layout"].items() if v is not None and k != "dp"}
    if "recompute" in run.get("assume", {}):  # the work done, not a layout choice: kept
        pub.setdefault("recompute", run["assume"]["recompute"])
    want = {k: pub[k] for k in MATCH_KEYS if k in pub}
    for i, sk in enumerate(_skeletons(result)):
        if any(dict(zip(MATCH_KEYS, sk))[k] != v for k, v in want.items()):
            continue
        lo = result.layout(i)
        if all(getattr(lo, k) == v for k, v in pub.items()):
            return i
    return None


def _distinct_rank(result, want: dict) -> int | None:
    """1-based rank of the first layout matching ``want`` among the distinct (tp, pp, vpp,
    micro-batch) layouts, best first: variants of one layout that differ only in SP, recompute,
    ZeRO or DP reduction count once, at their best."""
    seen: dict[tuple, int] = {}
    for sk in _skeletons(result):
        if sk in seen:
            continue
        seen[sk] = len(seen) + 1
        if all(dict(zip(MATCH_KEYS, sk))[k] == v for k, v in want.items()):
            return seen[sk]
    return None


def _skeletons(result):
    """(tp, pp, vpp, micro_batch) of each feasible layout in ranked order; from the search's
    arrays when it exposes them, else one LayoutConfig at a time."""
    arr = getattr(result, "arrays", None) or {}
    if all(k in arr for k in ("tp", "pp", "vpp", "mb")):
        cols = [arr[k][: result.count].tolist() for k in ("tp", "pp", "vpp", "mb")]
        return zip(*cols)
    return ((lo.tp, lo.pp, lo.vpp, lo.micro_batch)
            for lo in (result.layout(i) for i in range(result.count)))


def validate(path: Path = DATA, with_search: bool = True) -> tuple[dict, list[Result]]:
    """Every run of the dataset evaluated (and searched); runs the planner cannot take are
    reported with the reason rather than dropped."""
    data = load(path)
    results = []
    for run in data["runs"]:
        try:
            res = evaluate_run(data, run)
        except MscaleError as e:
            res = Result(run["id"], run["source"], bool(run.get("fit")), run["figure"]["kind"],
                         float(run["figure"]["value"]), float("nan"), float("nan"), float("nan"),
                         float("nan"), False, "", error_note=str(e).splitlines()[0])
            results.append(res)
            continue
        if with_search:
            rank_in_search(data, run, res)
        results.append(res)
    return data, results


@dataclass
class Summary:
    """Per-source accuracy: the figures the issue asks for."""

    source: str
    rows: int
    median_abs: float
    max_abs: float
    signed_median: float
    within_10: int
    top3: int | None
    fitting: bool
    fit_memory: int
    """Published layouts the planner's memory model accepts (each of them ran, so all should)."""
    tuned_median: float | None = None
    """Median abs. error when unpublished fields take the search's best values instead."""


def summarize(data: dict, results: list[Result]) -> list[Summary]:
    """One Summary per source, then one for every held-out row together (source '(held out)')."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        if r.error == r.error:  # not NaN
            groups.setdefault(r.source, []).append(r)
    held = [r for s, rs in groups.items() if s != data.get("fitting_source") for r in rs]
    out = [_summary(s, rs, s == data.get("fitting_source")) for s, rs in groups.items()]
    if held:
        out.append(_summary("(held out)", held, False))
    return out


def _summary(source: str, rs: list[Result], fitting: bool) -> Summary:
    errs = [r.error for r in rs]
    searched = [r for r in rs if r.top3 is not None]
    tuned = [abs(r.tuned_error) for r in rs if r.tuned_error is not None]
    return Summary(source, len(rs), statistics.median(abs(e) for e in errs),
                   max(abs(e) for e in errs), statistics.median(errs),
                   sum(abs(e) <= 0.10 for e in errs),
                   sum(bool(r.top3) for r in searched) if searched else None, fitting,
                   sum(r.fits_any for r in rs),
                   statistics.median(tuned) if tuned else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-search", action="store_true", help="errors only; print, write nothing")
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--label", help="what planner produced the figures (default: from git)")
    ap.add_argument("--save-baseline", action="store_true",
                    help=f"also store this summary as the baseline shown next time ({BASELINE.name})")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data, results = validate(with_search=not args.no_search)
    summaries, label = summarize(data, results), args.label or planner_state()
    if args.save_baseline:
        BASELINE.write_text(json.dumps({"label": label, "summaries": [
            dataclasses.asdict(s) for s in summaries]}, indent=1) + "\n")
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else None
    text = render(data, results, summaries, COMMAND, label, baseline)
    if args.no_search:
        print(text)
        return
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(results)} runs, {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
