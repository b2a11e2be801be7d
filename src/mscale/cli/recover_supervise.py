"""``mscale recover supervise -- CMD``: run a training job and recover it each time it fails."""

from __future__ import annotations

import os

import typer

from mscale.cli.recover import recover_app


@recover_app.command("supervise", context_settings={"ignore_unknown_options": True,
                                                    "allow_interspersed_args": False})
def supervise_cmd(
    command: list[str] = typer.Argument(..., metavar="CMD", help="The launch command after --, "
                                        "e.g. mscale train plan.yaml --local 8 --run-dir runs/r1"),
    max_restarts: int = typer.Option(5, "--max-restarts", min=0, help="Most restarts within "
                                     "--window; one more failure ends supervision (exit 2)."),
    window: float = typer.Option(3600.0, "--window", min=1.0, help="Seconds of the restart "
                                 "budget's sliding window."),
    backoff: float = typer.Option(10.0, "--backoff", min=0.0, help="Seconds before the first "
                                  "restart in the window, doubled for each further one "
                                  "(at most 600)."),
    watch: bool = typer.Option(True, "--watch/--no-watch", help="Run watch's rules on the run "
                               "while it trains: a sick node is checkpointed, quarantined, and "
                               "the job relaunched without it, losing no step."),
    run_dir: str = typer.Option(None, "--run-dir", help="The run directory, when CMD does not "
                                "name it (an sbatch script)."),
    ckpt_wait: float = typer.Option(300.0, "--ckpt-wait", min=1.0, help="Longest wait of watch "
                                    "for the checkpoint it requests before a quarantine."),
    interval: float = typer.Option(0.5, "--interval", min=0.05, help="Seconds between looks at "
                                   "the job."),
    allow_batch_change: bool = typer.Option(False, "--allow-batch-change", help="Let a re-plan "
                                            "change the global batch when no layout keeps it."),
    watch_set: list[str] = typer.Option([], "--watch-set", hidden=True, metavar="NAME=VALUE",
                                        help="Override a watch threshold (tests)."),
) -> None:
    """Run CMD; on a failure diagnose, exclude, re-plan and restart from the last good checkpoint.

    Exit 0 trained, 1 halted on request, 2 unrecoverable or the restart budget spent, 3 bad input.
    Each recovery's phases (detect, diagnose, restart, catch-up) are timed in events.jsonl.
    """
    from mscale.errors import MscaleError
    from mscale.recover.supervise import SuperviseOptions, Supervisor
    from mscale.recover.supervise_watch import parse_watch_settings

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise MscaleError("no command to supervise", field="CMD",
                          fix="put the launch command after --, e.g. mscale recover supervise "
                              "-- mscale train plan.yaml --local 8 --run-dir runs/r1")
    if os.path.basename(command[0]) == "sbatch" and not _sbatch_waits(command):
        # sbatch returns once the job is queued: its exit 0 would read as "trained to the end"
        raise MscaleError("sbatch without --wait returns when the job is queued, not when it "
                          "ends: supervise would take the submission for the job",
                          field="CMD", fix="mscale recover supervise --run-dir RUN -- sbatch "
                          "--wait job.sh")
    opts = SuperviseOptions(max_restarts=max_restarts, window_s=window, backoff_s=backoff,
                            watch=watch, watch_settings=parse_watch_settings(watch_set),
                            ckpt_wait_s=ckpt_wait, interval_s=interval,
                            allow_batch_change=allow_batch_change)
    raise typer.Exit(Supervisor(command, opts, run_dir=run_dir).run_all())


def _sbatch_waits(command: list[str]) -> bool:
    """Whether an sbatch line waits for its job: ``--wait``/``-W`` among sbatch's own options
    (before the script, a file; after it they are the script's arguments) or ``SBATCH_WAIT``
    set."""
    from mscale.recover.command import batch_script_index

    if os.environ.get("SBATCH_WAIT"):
        return True
    own = command[1:batch_script_index(command)]  # after the script: its own arguments
    return any(w in ("--wait", "-W") for w in own)

