"""``mscale train``: run the 3D-parallel engine under torchrun, srun, or ``--local N``."""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path

import typer

from mscale.cli.app import app
from mscale.errors import MscaleError

DEFAULT_PLAN = "cpu-tiny (embedded)"


def _plan_path(plan: str | None) -> str:
    if plan:
        return plan
    return str(resources.files("mscale") / "presets" / "cpu-tiny.yaml")


def _parse_delays(values: list[str]) -> dict[int, float]:
    out = {}
    for v in values:
        try:
            rank, seconds = v.split(":")
            out[int(rank)] = float(seconds)
        except ValueError:
            raise MscaleError(f"--inject-delay {v!r} is not RANK:SECONDS", field="--inject-delay",
                              fix="e.g. --inject-delay 3:0.5 slows rank 3 by 0.5 s per step")
    return out


@app.command("train")
def train_cmd(
    plan: str = typer.Argument(None, help=f"Plan file from `mscale plan`. Default: {DEFAULT_PLAN}."),
    run_dir: str = typer.Option("runs/demo", "--run-dir", help="Run directory (path or fsspec URL)."),
    local: int = typer.Option(0, "--local", help="Start this many worker processes on this machine."),
    steps: int = typer.Option(None, "--steps", help="Override training.steps."),
    inject_delay: list[str] = typer.Option([], "--inject-delay", metavar="RANK:SECONDS",
                                           help="Test hook: slow one rank's compute each step."),
    inject_nan: int = typer.Option(None, "--inject-nan", metavar="STEP",
                                   help="Test hook: make the loss NaN at this step."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds before a hung collective fails."),
    log_interval: int = typer.Option(1, "--log-interval", help="Steps between progress lines."),
    resume: str = typer.Option("auto", "--resume", help="auto: continue from RUN_DIR/ckpt/latest "
                               "if any; none: start fresh; or a checkpoint/run directory."),
    ckpt_interval: int = typer.Option(None, "--ckpt-interval", min=1, help="Steps between "
                                      "checkpoints (default: training.checkpoint_interval, else "
                                      "the plan's advice)."),
    ckpt_keep: int = typer.Option(3, "--ckpt-keep", min=1, help="Committed checkpoints to keep."),
    ckpt_level: int = typer.Option(1, "--ckpt-level", min=-7, max=22,
                                   help="zstd level of checkpoint chunks; 0 = uncompressed."),
    final_ckpt: bool = typer.Option(True, "--final-ckpt/--no-final-ckpt",
                                    help="Save a checkpoint after the last step."),
    inject_ckpt_delay: float = typer.Option(0.0, "--inject-ckpt-delay", hidden=True,
                                            help="Test hook: writer sleeps this long per chunk."),
) -> None:
    """Train the plan's model. Exit 0 done, 1 halted on request, 2 NaN/Inf, 3 bad input/crash."""
    from mscale.config.plan import load_plan

    path = _plan_path(plan)
    resolved = load_plan(path)  # bad input fails here, once, before any process starts
    delays = _parse_delays(inject_delay)
    ckpt = {"resume": resume, "ckpt_interval": ckpt_interval, "ckpt_keep": ckpt_keep,
            "ckpt_level": ckpt_level, "ckpt_final": final_ckpt,
            "inject_ckpt_delay": inject_ckpt_delay}
    if local:
        world = resolved.layout.world_size
        if local != world:
            raise MscaleError(f"--local {local} but the plan's layout needs {world} processes",
                              file=path, field="layout",
                              fix=f"use --local {world}, or plan for {local} processes")
        from mscale.train.launch import launch_local

        worker = _worker_args(path, run_dir, steps, inject_delay, inject_nan, timeout, log_interval)
        worker += _ckpt_args(ckpt)
        code = launch_local(local, resolved.cluster.gpus_per_node, worker,
                            log_dir=os.path.join(run_dir, "logs"))
        raise typer.Exit(code)
    _run_worker(resolved, run_dir, steps, delays, inject_nan, timeout, log_interval, ckpt)


def _ckpt_args(ckpt: dict) -> list[str]:
    """The checkpoint options, passed on to every worker unchanged."""
    args = ["--resume", ckpt["resume"], "--ckpt-keep", str(ckpt["ckpt_keep"]),
            "--ckpt-level", str(ckpt["ckpt_level"])]
    if ckpt["ckpt_interval"]:
        args += ["--ckpt-interval", str(ckpt["ckpt_interval"])]
    if not ckpt["ckpt_final"]:
        args.append("--no-final-ckpt")
    if ckpt["inject_ckpt_delay"]:
        args += ["--inject-ckpt-delay", str(ckpt["inject_ckpt_delay"])]
    return args


def _worker_args(path, run_dir, steps, delays, nan, timeout, log_interval) -> list[str]:
    args = ["train", str(Path(path).resolve()) if "://" not in path else path, "--run-dir", run_dir,
            "--timeout", str(timeout), "--log-interval", str(log_interval)]
    if steps:
        args += ["--steps", str(steps)]
    for d in delays:
        args += ["--inject-delay", d]
    if nan:
        args += ["--inject-nan", str(nan)]
    return args


def _run_worker(plan, run_dir, steps, delays, nan, timeout, log_interval, ckpt) -> None:
    """One process of the job: read the launcher's environment, train, exit cleanly."""
    from mscale.dist.init import shutdown_and_exit
    from mscale.topology.env import read_launch_env
    from mscale.train.loop import train
    from mscale.train.options import TrainOptions

    env = read_launch_env()
    options = TrainOptions(run_dir=run_dir, steps=steps, inject_delay=delays,
                           inject_nan_step=nan, timeout_s=timeout, log_interval=log_interval,
                           **ckpt)
    try:
        code = train(plan, options, env)
    except MscaleError as e:
        sys.stderr.write(f"error (rank {env.rank}): {e}\n")
        shutdown_and_exit(e.code, barrier=False)
    # a clean exit synchronises all ranks; after a failure peers may be gone, so no barrier
    shutdown_and_exit(code, barrier=code in (0, 1, 2))
