"""`mscale plan`: search the layouts of a model on a cluster, or evaluate a given one, and write
the chosen plan. Thin: parse, call mscale.planner, print, pick the exit code (docs/plan.md)."""

from __future__ import annotations

import math
from typing import Optional

import typer

from mscale.cli.app import app
from mscale.cli.output import console, print_json
from mscale.config import ClusterConfig, ModelConfig, TrainingConfig
from mscale.config.base import dump_yaml, parse_yaml, validate
from mscale.config.files import read_text
from mscale.errors import MscaleError
from mscale.planner.advice import no_fit_error
from mscale.planner.calibrate import Calibration, fit_speed, load_calibration
from mscale.planner.cost import Problem, evaluate
from mscale.planner.given import given_layout
from mscale.planner.goodput import GoodputInputs
from mscale.planner.planfile import make_plan
from mscale.planner.report import (Row, distinct, json_document, layout_table, losses_table,
                                   memory_table, rejects_table)
from mscale.planner.search import describe, search
from mscale.runs.atomic import write_text_atomic
from mscale.runs.targets import check_output


def _finite(value: float) -> float:
    """click's float ranges let ``nan`` and ``inf`` through (nan compares false with any bound);
    the checkpoint advice would turn them into a crash or a meaningless interval."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


@app.command("plan")
def plan_cmd(
    cluster: str = typer.Option(..., "--cluster", help="Cluster YAML (plans/clusters/); a path "
                                "or fsspec URL, like every file option."),
    model: str = typer.Option(..., "--model", help="Model YAML (plans/models/)."),
    training: str = typer.Option(..., "--training", help="Training YAML (plans/training/)."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the chosen plan "
                                         "here: the best layout, even when one is given, unless "
                                         "--keep-given."),
    top: int = typer.Option(5, "--top", min=1, help="Show the best N layouts."),
    explain: bool = typer.Option(False, "--explain", help="Show why layouts were rejected."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    name: Optional[str] = typer.Option(None, "--name", help="Plan name (default: the model's)."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Evaluate this layout (a layout "
                                         "YAML or a plan) next to the best."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Given layout: tensor-parallel size."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Given layout: pipeline stages."),
    vpp: Optional[int] = typer.Option(None, "--vpp", help="Given layout: virtual stages per rank."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Given layout."),
    sp: Optional[bool] = typer.Option(None, "--sp/--no-sp", help="Given layout: sequence parallel."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="none|selective|full."),
    zero: Optional[int] = typer.Option(None, "--zero", help="Given layout: ZeRO stage 0|1|2."),
    dp_reduce: Optional[str] = typer.Option(None, "--dp-reduce", help="flat|hierarchical."),
    keep_given: bool = typer.Option(False, "--keep-given", help="With -o, write the given layout "
                                    "instead of the best."),
    failure_rate: float = typer.Option(GoodputInputs.failures_per_1000_node_days, "--failure-rate",
                                       min=0.0, callback=_finite,
                                       help="Failures per 1000 node-days."),
    restart_s: float = typer.Option(GoodputInputs.restart_s, "--restart-s", min=0.0,
                                    callback=_finite,
                                    help="Seconds from a failure to relaunch, before loading."),
    write_gbps: float = typer.Option(GoodputInputs.write_gb_per_s, "--ckpt-write-gbps", min=0.001,
                                     callback=_finite,
                                     help="Aggregate checkpoint write bandwidth, GB/s."),
    stack: Optional[str] = typer.Option(None, "--stack", help="Price this training stack "
                                        "(mscale, megascale, megatron-lm, megatron-core, "
                                        "megatron-deepspeed, llama3); default: training.stack, "
                                        "else mscale."),
    calibrate: Optional[list[str]] = typer.Option(None, "--calibrate", help="A preflight.json "
                                                  "and/or a run's metrics.jsonl (with the layout "
                                                  "it ran given): measured rates replace "
                                                  "datasheet ones. Repeatable."),
) -> None:
    """Rank every valid parallel layout by predicted step time; write the best as plan.yaml."""
    if output:  # a search that cannot write its result is wasted: check the destination first
        check_output(output, "file", "-o")
    files = {"cluster": str(cluster), "model": str(model), "training": str(training)}
    configs = (_load_part(ModelConfig, model, "--model"),
               _load_part(TrainingConfig, training, "--training"),
               _load_part(ClusterConfig, cluster, "--cluster"))
    pb = Problem(*configs, stack=stack)
    pb.stack_profile  # an unknown --stack is refused before any work
    options = {"tp": tp, "pp": pp, "vpp": vpp, "micro_batch": micro_batch, "sequence_parallel": sp,
               "recompute": recompute, "zero_stage": zero, "dp_reduce": dp_reduce}
    given_lo = given_layout(pb, options, layout)
    if calibrate:
        pb = Problem(*configs, stack=stack, calibration=_calibration(configs, stack, calibrate,
                                                                     given_lo))
    if keep_given and given_lo is None:
        raise MscaleError("--keep-given needs a given layout", field="--keep-given",
                          fix="add --layout FILE or --tp/--pp/... options")
    given = (given_lo, evaluate(pb, given_lo)) if given_lo else None
    result = search(pb)
    if keep_given or (result.count == 0 and given is not None and given[1].fits):
        chosen = given
        if not chosen[1].fits:
            if result.count == 0:
                raise no_fit_error(pb, result, files)
            raise MscaleError(f"the given layout needs {chosen[1].mem_total / 1e9:.1f} GB per GPU, "
                              f"more than {pb.budget_bytes / 1e9:.1f} GB usable",
                              file=layout or "command line", field="layout",
                              fix=f"the best layout that fits is {describe(result.layout(0))}")
    elif result.count == 0:
        raise no_fit_error(pb, result, files)
    else:
        chosen = (result.layout(0), result.cost(0))
    goodput = GoodputInputs(failures_per_1000_node_days=failure_rate, restart_s=restart_s,
                            write_gb_per_s=write_gbps)
    plan = make_plan(pb, chosen[0], chosen[1], name or pb.model.name, goodput)
    if output:
        write_text_atomic(output, dump_yaml(plan))
    if as_json:
        print_json(json_document(result, top, given, plan.model_dump(
            mode="json", exclude_none=True, exclude={"placement"}), explain))
        return
    _print_human(result, top, given, plan, output, explain)


PLAN_SECTIONS = ("cluster", "model", "training", "layout")
"""Top-level keys of a plan file (config/plan.py); none is a field of a cluster, model or training
file, so finding one means a whole plan was given where one part was expected."""


def _load_part(schema, path: str, option: str):
    """Load the cluster, model or training file given as ``option``. A whole plan given instead
    would otherwise fail on its first missing field ("layers: required field is missing"),
    which does not say what is wrong; the file is read once (it may be a pipe)."""
    data = parse_yaml(read_text(path), str(path))
    found = [k for k in PLAN_SECTIONS if isinstance(data, dict) and k in data]
    if found:
        what = option.removeprefix("--")
        raise MscaleError(
            f"this looks like a whole plan (it has {', '.join(k + ':' for k in found)}), "
            f"not a {what} file", file=str(path), field=option,
            fix=f"give its parts as separate files (--cluster plans/clusters/X.yaml --model "
                f"plans/models/X.yaml --training plans/training/X.yaml) and the plan itself as "
                f"--layout {path} to price its layout next to the best")
    return validate(schema, data, str(path))


def _calibration(configs, stack, paths: list[str], given_lo) -> Calibration:
    """Measured rates from the files; a run's step time needs the layout it ran."""
    cal = load_calibration(paths)
    if cal.step_time_s is not None:
        if given_lo is None:
            raise MscaleError("a metrics.jsonl calibrates against the layout that run used",
                              field="--calibrate", fix="give that layout too: --layout "
                              "RUN/plan.yaml (or --tp/--pp/...)")
        fit_speed(cal, lambda c: evaluate(Problem(*configs, stack=stack, calibration=c),
                                          given_lo).step_time)
    return cal


def _print_human(result, top, given, plan, output, explain) -> None:
    pb = result.problem
    console.print(f"stack: {pb.stack_profile.name}"
                  + (f"; calibrated from {'; '.join(pb.calibration.sources)}"
                     if pb.calibration is not None else ""), markup=False)
    rows = distinct(result, top)
    if given:
        rows.append(Row("given", *given))
    console.print(layout_table(pb, rows))
    console.print(losses_table(rows))
    console.print(f"{result.count:,} layouts fit of {result.examined:,} costed.")
    if any(r.variants for r in rows):
        console.print("equal cost: other layouts the model prices the same (step time and "
                      "memory), folded into the row of the one ranked first, which is the one "
                      "shown", markup=False)
    if any(lo.stage_layers for r in rows for lo in (r.layout, *r.variants)):
        console.print("split a/b/c (a-b-c among the variants, where even is the default split): "
                      "blocks in the first, second and last virtual stage (0: the embedding "
                      "alone, or the head and loss alone); the plan lists every stage in "
                      "stage_layers", markup=False)
    if result.preferred_note:
        console.print(result.preferred_note, markup=False)
    chosen_cost = given[1] if given and plan.layout == given[0] else result.cost(0)
    console.print(memory_table(chosen_cost))
    ck = plan.checkpoint
    console.print(f"checkpoint every {ck.interval_steps} steps ({ck.interval_s:.0f} s; "
                  f"{plan.estimate['checkpoint_interval_note']}): job MTBF {ck.mtbf_h:.1f} h, "
                  f"blocking cost {ck.checkpoint_cost_s:.2f} s, restart {ck.restart_s:.0f} s → "
                  f"effective training {100 * ck.effective_training:.1f}%")
    if explain:
        console.print(rejects_table(result.rejects, result.examined))
    if output:
        console.print(f"wrote {output}: {describe(plan.layout)}")
