"""``mscale watch``: follow a run (or judge it once), name the slow rank and why, and act."""

from __future__ import annotations

import signal
import sys
import time

import typer

from mscale.cli.app import app
from mscale.cli.interrupt import stop_signals_as_interrupt
from mscale.errors import MscaleError


@app.command("watch")
def watch_cmd(
    target: str = typer.Argument(..., help="Run directory (path or fsspec URL), or a metrics "
                                 ".jsonl file written by any trainer (docs/watch.md)."),
    once: bool = typer.Option(False, "--once", help="Judge everything written so far and exit "
                              "(CI, batch scripts). Default: follow the run live until its stop."),
    no_act: bool = typer.Option(False, "--no-act", help="Only observe: write no event, control "
                                "request or quarantine entry."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document at the end."),
    jsonl: bool = typer.Option(False, "--jsonl", help="Print one JSON line per finding as found."),
    prometheus: str = typer.Option(None, "--prometheus", metavar="FILE", help="Keep a "
                                   "Prometheus textfile (node_exporter) up to date, atomically."),
    report: str = typer.Option(None, "--report", metavar="FILE.html", help="Write a "
                               "self-contained HTML report (curves, heat maps, findings) at the "
                               "end."),
    tp: int = typer.Option(None, "--tp", min=1, help="Tensor-parallel size (no plan.yaml)."),
    pp: int = typer.Option(None, "--pp", min=1, help="Pipeline-parallel size (no plan.yaml)."),
    dp: int = typer.Option(None, "--dp", min=1, help="Data-parallel size (default: the rest)."),
    ranks_per_node: int = typer.Option(None, "--ranks-per-node", min=1,
                                       help="Ranks per node (no plan.yaml)."),
    hostlist: str = typer.Option(None, "--hostlist", help="Node names in rank order, SLURM "
                                 "syntax, e.g. gpu[001-128] (no plan.yaml)."),
    hang_s: float = typer.Option(None, "--hang-s", min=1.0, help="Seconds "
                                 "without a record while the job is alive that count as a hang "
                                 "(default: from the step time)."),
    interval: float = typer.Option(2.0, "--interval", min=0.05, help="Seconds between looks "
                                   "at the run when following it."),
    ckpt_wait: float = typer.Option(300.0, "--ckpt-wait", min=1.0, help="Longest wait for "
                                    "the requested checkpoint before a sick node is "
                                    "quarantined anyway."),
) -> None:
    """Find stragglers (with their cause), gradient spikes, NaN, divergence, slowdowns and hangs,
    and say how the job's newest attempt ended.

    Exit 0 healthy, 1 warnings (a stop on request), 2 critical (also a job that crashed, was
    killed or hung), 3 bad input.
    """
    from mscale.runs.targets import check_lasting, check_output
    from mscale.watch.actions import ActionConfig, Actor
    from mscale.watch.config import WatchConfig
    from mscale.watch.follow import EventFeed, Follower
    from mscale.watch.target import layout_source, plan_hints, require_run, resolve_target
    from mscale.watch.judge import Watcher
    from mscale.watch.outputs import OutputOptions, Outputs
    from mscale.watch.stream import MetricsFeed, records_to_window

    if as_json and jsonl:  # both are stdout: one stream no JSON or JSONL reader could parse
        raise MscaleError("--json and --jsonl both write stdout (the document at the end, the "
                          "findings as found)", field="--jsonl",
                          fix="choose one: --json for one verdict document (CI), --jsonl for a "
                              "line per finding (a log shipper)")
    for url, flag, example in ((prometheus, "--prometheus", "mscale.prom"),
                               (report, "--report", "watch.html")):
        if url:
            check_lasting(url, flag)
            check_output(url, kind="file", what=flag, example=example)
    where = resolve_target(target)
    if once:
        require_run(where)
    flags = (tp, pp, dp, ranks_per_node, hostlist)
    layout_for = layout_source(where, *flags, note=lambda line: print(f"watch: {line}",
                                                                      file=sys.stderr))

    def make_watcher(layout):
        hints = plan_hints(where, flags_given=any(v is not None for v in flags))
        return Watcher(layout, WatchConfig(**hints, **({} if hang_s is None else
                                                       {"hang_s": hang_s})))

    actor = Actor(where.run, ActionConfig(act=not no_act, ckpt_wait_s=ckpt_wait))
    outputs = Outputs(OutputOptions(as_json=as_json, jsonl=jsonl, prometheus=prometheus,
                                    report=report))
    follower = Follower(
        target=where, layout_for=layout_for, make_watcher=make_watcher,
        feed=MetricsFeed(where.metrics), events=EventFeed(where.run.events) if where.run else None,
        to_window=records_to_window, actor=actor, outputs=outputs, live=not once, clock=time.time,
        note=outputs.note, report_end=True)
    try:
        # SIGTERM (systemd, Kubernetes, SLURM at a job's end) and SIGHUP end it as Ctrl-C does
        with stop_signals_as_interrupt(signal.SIGTERM, signal.SIGHUP):
            follower.run(interval)
    except BaseException:
        outputs.view.close()  # give the terminal back before the error is printed
        raise
    raise typer.Exit(outputs.finish(follower))
