"""`mscale plan`: search the layouts of a model on a cluster, or evaluate a given one, and write
the chosen plan. Thin: parse, call mscale.planner, print, pick the exit code (docs/plan.md)."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Optional

import typer

from mscale.cli.app import app
from mscale.cli.output import console, print_json
from mscale.config.plan import PLAN_NAME_MAX
from mscale.planner.goodput import GoodputInputs
from mscale.planner.stacks import STACKS

if TYPE_CHECKING:
    from mscale.planner.choose import Choice

# The search, its report and the checkpoint catalogue (numpy and more) are imported when `plan`
# runs, not when the CLI starts: every mscale command loads this module to build its parser.


def _finite(value: float) -> float:
    """click's float ranges let ``nan`` and ``inf`` through (nan compares false with any bound);
    the checkpoint advice would turn them into a crash or a meaningless interval."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _plan_name(value: Optional[str]) -> Optional[str]:
    """A name `train` prints in its one-line start and records: a name past the schema's 200
    characters ended the command, after the search, in an internal error (a pydantic
    traceback's summary); an empty one fell back to the model's without a word; a control
    character broke the start line in two."""
    if value is None:
        return None
    if not value.strip() or len(value) > PLAN_NAME_MAX or not value.isprintable():
        raise typer.BadParameter(f"{value[:40]!r}{'...' if len(value) > 40 else ''}: give a "
                                 f"printable name of 1 to {PLAN_NAME_MAX} characters, or leave "
                                 "--name out for the model's")
    return value


@app.command("plan")
def plan_cmd(
    cluster: str = typer.Option(..., "--cluster", help="Cluster YAML (plans/clusters/); a path "
                                "or fsspec URL, like every file option."),
    model: str = typer.Option(..., "--model", help="Model YAML (plans/models/)."),
    training: str = typer.Option(..., "--training", help="Training YAML (plans/training/)."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the chosen plan "
                                         "here: the layout ranked first (the fastest, or a "
                                         "simpler one within the model's error), even when one "
                                         "is given, unless --keep-given."),
    top: int = typer.Option(5, "--top", min=1, help="Show the best N layouts."),
    explain: bool = typer.Option(False, "--explain", help="Show why layouts were rejected."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout."),
    name: Optional[str] = typer.Option(None, "--name", callback=_plan_name,
                                       help="Plan name (default: the model's)."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Evaluate this layout (a layout "
                                         "YAML or a plan) next to the best."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Given layout: tensor-parallel size."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Given layout: pipeline stages."),
    vpp: Optional[int] = typer.Option(None, "--vpp",
                                      help="Given layout: virtual stages per rank."),
    micro_batch: Optional[int] = typer.Option(None, "--micro-batch", help="Given layout."),
    sp: Optional[bool] = typer.Option(None, "--sp/--no-sp",
                                      help="Given layout: sequence parallel."),
    recompute: Optional[str] = typer.Option(None, "--recompute", metavar="none|selective|full",
                                            help="Given layout: activation recompute."),
    zero: Optional[int] = typer.Option(None, "--zero", help="Given layout: ZeRO stage 0|1|2."),
    dp_reduce: Optional[str] = typer.Option(None, "--dp-reduce", metavar="flat|hierarchical",
                                            help="Given layout: how DP gradients are reduced."),
    keep_given: bool = typer.Option(False, "--keep-given", help="With -o, write the given layout "
                                    "instead of the best."),
    failure_rate: float = typer.Option(GoodputInputs.failures_per_1000_node_days, "--failure-rate",
                                       callback=_finite,  # > 0: planner/goodput.py says so
                                       help="Failures per 1000 node-days."),
    restart_s: float = typer.Option(GoodputInputs.restart_s, "--restart-s", min=0.0,
                                    callback=_finite,
                                    help="Seconds from a failure to relaunch, before loading."),
    write_gbps: float = typer.Option(GoodputInputs.write_gb_per_s, "--ckpt-write-gbps", min=0.001,
                                     callback=_finite,
                                     help="Aggregate checkpoint write bandwidth, GB/s."),
    stack: Optional[str] = typer.Option(None, "--stack", help="Price this training stack "
                                        f"({', '.join(STACKS)}); default: training.stack, "
                                        "else mscale (mscale-eager when training.compile is "
                                        "false)."),
    calibrate: Optional[list[str]] = typer.Option(None, "--calibrate", help="A preflight.json "
                                                  "and/or a run's metrics.jsonl (with the layout "
                                                  "it ran given): measured rates replace "
                                                  "datasheet ones. Repeatable."),
) -> None:
    """Rank every valid parallel layout by predicted step time; write the best as plan.yaml."""
    from mscale.config.base import dump_yaml
    from mscale.planner.choose import choose, load_parts
    from mscale.planner.planfile import make_plan
    from mscale.planner.report import json_document
    from mscale.planner.search import describe
    from mscale.runs.atomic import write_text_atomic
    from mscale.runs.targets import check_lasting, check_not_an_input, check_output

    if output:  # a search that cannot write its result is wasted: check the destination first
        check_lasting(output, "-o")
        check_not_an_input(output, "-o", [("--cluster", cluster), ("--model", model),
                                          ("--training", training),
                                          *(("--calibrate", c) for c in calibrate or [])])
        check_output(output, "file", "-o")
    options = {"tp": tp, "pp": pp, "vpp": vpp, "micro_batch": micro_batch, "sequence_parallel": sp,
               "recompute": recompute, "zero_stage": zero, "dp_reduce": dp_reduce}
    choice = choose(load_parts(model, training, cluster), stack=stack, options=options,
                    layout_path=layout, calibrate=calibrate, keep_given=keep_given,
                    files={"cluster": str(cluster), "model": str(model),
                           "training": str(training)})
    pb = choice.problem
    goodput = GoodputInputs(failures_per_1000_node_days=failure_rate, restart_s=restart_s,
                            write_gb_per_s=write_gbps)
    plan = make_plan(pb, choice.layout, choice.cost, name or pb.model.name, goodput)
    if output:
        write_text_atomic(output, dump_yaml(plan))
    if as_json:
        print_json(json_document(choice.result, top, choice.given, plan.model_dump(
            mode="json", exclude_none=True, exclude={"placement"}), explain))
        if output:  # stdout is the document; a file written unannounced is one nobody knows of
            sys.stderr.write(f"wrote {output}: {describe(plan.layout)}\n")
        return
    _print_human(choice, top, plan, output, explain, write_gbps)


CPU_NOTE = ("note: on CPUs (gpu: cpu) the step time, tokens/s and MFU columns are not "
            "predictions (gloo's per-collective latency and many processes on few cores "
            "dominate, calibrated or not; docs/plan.md, The cpu preset): use this plan for a "
            "valid layout, and `mscale train`'s own figures for speed")
"""Said under the table of a CPU cluster, whose figures a reader would otherwise take as the
planner's word: the cost model's rates are those of GPUs."""


def _print_human(choice: Choice, top: int, plan, output: str | None, explain: bool,
                 write_gbps: float) -> None:
    from mscale.ckpt.listing import format_bytes
    from mscale.planner.constants import CHECKPOINT_BYTES_PER_PARAM
    from mscale.planner.report import (Row, distinct, layout_table, losses_table, memory_table,
                                       rejects_table)
    from mscale.planner.search import describe

    result, given, pb = choice.result, choice.given, choice.problem
    console.print(f"stack: {pb.stack_profile.name}"
                  + (f"; calibrated from {'; '.join(pb.calibration.sources)}"
                     if pb.calibration is not None else ""), markup=False, soft_wrap=True)
    rows = distinct(result, top)
    if given:
        rows.append(Row("given", *given))
    console.print(layout_table(pb, rows))
    console.print(losses_table(rows))
    console.print(f"{result.count:,} layout{'' if result.count == 1 else 's'} fit"
                  f"{'s' if result.count == 1 else ''} of {result.examined:,} costed.")
    if any(r.variants for r in rows):
        console.print("equal cost: other layouts the model prices the same (step time and "
                      "memory), folded into the row of the one ranked first, which is the one "
                      "shown", markup=False, soft_wrap=True)
    if any(lo.stage_layers for r in rows for lo in (r.layout, *r.variants)):
        console.print("split a/b/c (a-b-c among the variants, where even is the default split): "
                      "blocks in the first, second and last virtual stage (0: the embedding "
                      "alone, or the head and loss alone); the plan lists every stage in "
                      "stage_layers", markup=False, soft_wrap=True)
    if result.preferred_note:
        console.print(result.preferred_note, markup=False, soft_wrap=True)
    if pb.cluster.gpu.is_cpu:
        console.print(CPU_NOTE, markup=False, soft_wrap=True)
    console.print(memory_table(choice.cost))
    ck = plan.checkpoint
    size = plan.model.num_parameters() * CHECKPOINT_BYTES_PER_PARAM
    console.print(f"checkpoint every {ck.interval_steps} steps ({ck.interval_s:.0f} s; "
                  f"{plan.estimate['checkpoint_interval_note']}): job MTBF {ck.mtbf_h:.3g} h, "
                  f"blocking cost {ck.checkpoint_cost_s:.2f} s, restart {ck.restart_s:.0f} s → "
                  f"effective training {100 * ck.effective_training:.1f}%; assumes "
                  f"{format_bytes(size)} per checkpoint ({CHECKPOINT_BYTES_PER_PARAM} B/param) "
                  f"written at {write_gbps:g} GB/s (--ckpt-write-gbps; `mscale preflight` "
                  "measures your storage)", soft_wrap=True)
    if explain:
        console.print(rejects_table(result.rejects, result.examined))
    if output:
        console.print(f"wrote {output}: {describe(plan.layout)}")
