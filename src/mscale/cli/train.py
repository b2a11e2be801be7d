"""``mscale train``: run the 3D-parallel engine under torchrun, srun, or ``--local N``."""

from __future__ import annotations

import os
import sys
from importlib import resources

import typer

from mscale.ckpt.limits import MAX_LEVEL, MIN_LEVEL
from mscale.cli.app import app
from mscale.cli.output import parse_rank_values
from mscale.errors import MscaleError

DEMO_RUN_DIR = "runs/demo"


def _positive(name: str):
    def check(value: float | None):
        if value is not None and not value > 0:
            raise typer.BadParameter(f"{name} must be > 0 (got {value})")
        return value
    return check


def _parse_delays(values: list[str], flag: str) -> dict[int, float]:
    return parse_rank_values(values, flag, "SECONDS", (0, 3600), "3:0.5", closed=False)


def _parse_steps(values: list[str], flag: str) -> dict[int, int]:
    """``RANK:STEP`` fault hooks into {rank: step}; a step is a whole number >= 1."""
    out = parse_rank_values(values, flag, "STEP", (1, 1e9), "1:3")
    for v, step in zip(values, out.values()):
        if step != int(step):
            raise MscaleError(f"{v!r}: STEP must be a whole number", field=flag,
                              fix=f"e.g. {flag} 1:3")
    return {rank: int(step) for rank, step in out.items()}


def _trace_ranks(value: str) -> str:
    if value not in ("replica", "all"):
        raise MscaleError(f"--trace-ranks {value!r} is not replica or all", field="--trace-ranks",
                          fix="--trace-ranks replica (DP replica 0's pipeline) or all")
    return value


def launch_of(plan: str, local: int) -> dict:
    """How this command was launched, for the start event (`mscale recover` relaunches it):
    argv is runnable again (``python -m mscale.cli.main`` when started that way)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        argv[:1] = [sys.executable, "-m", "mscale.cli.main"]
    return {"argv": argv, "cwd": os.getcwd(), "local": local,
            "plan": plan if "://" in plan else os.path.abspath(plan)}


@app.command("train")
def train_cmd(
    plan: str = typer.Argument(None, help="Plan file from `mscale plan`. Default: the embedded "
                               "cpu-tiny demo (8 gloo processes, tp2·pp2·dp2)."),
    run_dir: str = typer.Option(None, "--run-dir", help="Run directory (path or fsspec URL). "
                                f"Required with a plan; the embedded demo uses {DEMO_RUN_DIR}."),
    local: int = typer.Option(0, "--local", min=0, help="Start this many worker processes on "
                              "this machine (must equal the plan's world size)."),
    steps: int = typer.Option(None, "--steps", min=1, help="Train this many steps instead of "
                              "training.steps; the LR schedule is laid over them."),
    timeout: float = typer.Option(120.0, "--timeout", callback=_positive("--timeout"),
                                  help="Seconds before a hung collective fails the job."),
    log_interval: int = typer.Option(1, "--log-interval", min=1,
                                     help="Steps between progress lines."),
    trace_every: int = typer.Option(0, "--trace-every", min=0, help="Steps between timelines "
                                    "written to RUN_DIR/trace/ (Perfetto / chrome://tracing); "
                                    "0: only when RUN_DIR/control/trace asks."),
    trace_ranks: str = typer.Option("replica", "--trace-ranks", help="Whose events a timeline "
                                    "holds: replica (DP replica 0's pipeline) or all."),
    resume: str = typer.Option("auto", "--resume", help="auto: continue from RUN_DIR/ckpt/latest "
                               "if any; none: start fresh; or a checkpoint/run directory."),
    ckpt_interval: int = typer.Option(None, "--ckpt-interval", min=1, help="Steps between "
                                      "checkpoints (default: training.checkpoint_interval, else "
                                      "the plan's advice)."),
    ckpt_keep: int = typer.Option(3, "--ckpt-keep", min=1, help="Committed checkpoints to keep."),
    zstd_level: int = typer.Option(None, "--zstd-level", min=MIN_LEVEL, max=MAX_LEVEL,
                                   help="zstd level of checkpoint chunks; 0 = uncompressed "
                                   "[default: 1]."),
    ckpt_level: int = typer.Option(None, "--ckpt-level", min=MIN_LEVEL, max=MAX_LEVEL, hidden=True,
                                   help="Old spelling of --zstd-level."),
    final_ckpt: bool = typer.Option(True, "--final-ckpt/--no-final-ckpt",
                                    help="Save a checkpoint after the last step."),
    allow_batch_change: bool = typer.Option(False, "--allow-batch-change", help="Accept a plan "
                                            "whose global batch differs from the run "
                                            "directory's; the data continues from the samples "
                                            "already consumed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary document at the "
                                 "end on stdout (console lines go to stderr)."),
    inject_delay: list[str] = typer.Option([], "--inject-delay", hidden=True,
                                           help="Test hook RANK:SECONDS: slow one rank's compute."),
    inject_data_delay: list[str] = typer.Option([], "--inject-data-delay", hidden=True,
                                                help="Test hook RANK:SECONDS: slow one rank's "
                                                "data loader."),
    inject_nan: int = typer.Option(None, "--inject-nan", min=1, hidden=True,
                                   help="Test hook: make the loss NaN at this step."),
    inject_ckpt_delay: float = typer.Option(0.0, "--inject-ckpt-delay", min=0, hidden=True,
                                            help="Test hook: writer sleeps this long per chunk."),
    inject_crash: list[str] = typer.Option([], "--inject-crash", hidden=True, help="Test hook "
                                           "RANK:STEP: that rank SIGKILLs itself mid-step."),
    inject_hang: list[str] = typer.Option([], "--inject-hang", hidden=True, help="Test hook "
                                          "RANK:STEP: that rank SIGSTOPs itself mid-step."),
    inject_ckpt_enospc: int = typer.Option(None, "--inject-ckpt-enospc", min=1, hidden=True,
                                           help="Test hook: the save of STEP fails with ENOSPC."),
    inject_ckpt_kill: list[str] = typer.Option([], "--inject-ckpt-kill", hidden=True,
                                               help="Test hook RANK:STEP: SIGKILL mid-write."),
    inject_ckpt_hang: list[str] = typer.Option([], "--inject-ckpt-hang", hidden=True,
                                               help="Test hook RANK:STEP: SIGSTOP mid-write."),
) -> None:
    """Train the plan's model. Exit 0 done, 1 halted on request, 2 NaN/Inf, 3 bad input/crash."""
    from mscale.train.launch import check_before_launch, launch_job, options_from_env
    from mscale.ckpt.options import CkptOptions
    from mscale.train.options import TrainOptions

    if plan is None:
        plan = str(resources.files("mscale") / "presets" / "cpu-tiny.yaml")
        run_dir = run_dir or DEMO_RUN_DIR
    elif run_dir is None:
        raise MscaleError("--run-dir is required with a plan", field="--run-dir",
                          fix="name the run directory, e.g. --run-dir runs/my-run (a run directory "
                              "belongs to one model; reusing another run's would resume it)")
    level = zstd_level if zstd_level is not None else (ckpt_level if ckpt_level is not None else 1)
    options = options_from_env() or TrainOptions(
        run_dir=run_dir, steps=steps, inject_delay=_parse_delays(inject_delay, "--inject-delay"),
        inject_data_delay=_parse_delays(inject_data_delay, "--inject-data-delay"),
        inject_nan_step=inject_nan, timeout_s=timeout, log_interval=log_interval,
        trace_every=trace_every, trace_ranks=_trace_ranks(trace_ranks),
        inject_crash=_parse_steps(inject_crash, "--inject-crash"),
        inject_hang=_parse_steps(inject_hang, "--inject-hang"),
        json_summary=as_json and not local, launch=launch_of(plan, local),
        allow_batch_change=allow_batch_change,
        ckpt=CkptOptions(interval=ckpt_interval, keep=ckpt_keep, resume=resume, level=level,
                         final=final_ckpt, chunk_delay_s=inject_ckpt_delay,
                         inject_enospc_step=inject_ckpt_enospc,
                         inject_kill=_parse_steps(inject_ckpt_kill, "--inject-ckpt-kill"),
                         inject_hang=_parse_steps(inject_ckpt_hang, "--inject-ckpt-hang")))
    from mscale.cli.app import STATE

    if STATE["debug"]:  # workers (started by --local, srun or torchrun) print full tracebacks
        os.environ["MSCALE_DEBUG"] = "1"
    resolved = check_before_launch(plan, options, local)
    if local:  # the launcher never imports torch: only its workers do (seconds per start)
        raise typer.Exit(launch_job(plan, resolved, options, local, as_json=as_json))
    from mscale.train.worker import run_worker

    run_worker(resolved, options)
