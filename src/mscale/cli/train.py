"""``mscale train``: run the 3D-parallel engine under torchrun, srun, or ``--local N``."""

from __future__ import annotations

import os
import sys
from importlib import resources

import typer

from mscale.cli.app import app
from mscale.cli.options import build as build_options
from mscale.cli.options import with_flags
from mscale.errors import MscaleError
from mscale.train.options import TrainOptions

DEMO_RUN_DIR = "runs/demo"


def launch_of(plan: str, local: int) -> dict:
    """How this command was launched, for the start event (`mscale recover` relaunches it):
    argv is runnable again (``python -m mscale.cli.main`` when started that way)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        argv[:1] = [sys.executable, "-m", "mscale.cli.main"]
    return {"argv": argv, "cwd": os.getcwd(), "local": local,
            "plan": plan if "://" in plan else os.path.abspath(plan)}


@app.command("train")
@with_flags(TrainOptions)
def train_cmd(
    plan: str = typer.Argument(None, help="Plan file from `mscale plan`. Default: the embedded "
                               "cpu-tiny demo (8 gloo processes, tp2·pp2·dp2)."),
    run_dir: str = typer.Option(None, "--run-dir", help="Run directory (path or fsspec URL). "
                                f"Required with a plan; the embedded demo uses {DEMO_RUN_DIR}."),
    local: int = typer.Option(0, "--local", min=0, help="Start this many worker processes on "
                              "this machine (must equal the plan's world size)."),
    **flags,
) -> None:
    """Train the plan's model. Exit 0 done, 1 halted on request, 2 NaN/Inf, 3 bad input/crash,
    130 interrupted without a checkpoint (a second Ctrl-C)."""
    # every flag in **flags is a field of TrainOptions (or its ckpt/faults), help = its docstring
    from mscale.train.launch import check_before_launch, launch_job, options_from_env

    if plan is None:
        plan = str(resources.files("mscale") / "presets" / "cpu-tiny.yaml")
        run_dir = run_dir or DEMO_RUN_DIR
    elif run_dir is None:
        raise MscaleError("--run-dir is required with a plan", field="--run-dir",
                          fix="name the run directory, e.g. --run-dir runs/my-run (a run directory "
                              "belongs to one model; reusing another run's would resume it)")
    from mscale.runs.targets import check_lasting

    check_lasting(run_dir, "--run-dir")
    as_json = flags["json_summary"]
    flags["json_summary"] = as_json and not local  # --local: the launcher prints the document
    options = options_from_env() or build_options(TrainOptions, flags, run_dir=run_dir,
                                                  launch=launch_of(plan, local))
    from mscale.cli.app import STATE

    if STATE["debug"]:  # workers (started by --local, srun or torchrun) print full tracebacks
        os.environ["MSCALE_DEBUG"] = "1"
    resolved = check_before_launch(plan, options, local)
    if local:  # the launcher never imports torch: only its workers do (seconds per start)
        raise typer.Exit(launch_job(plan, resolved, options, local, as_json=as_json))
    from mscale.train.worker import run_worker

    run_worker(resolved, options)
