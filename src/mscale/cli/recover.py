"""``mscale recover RUN_DIR``: diagnose a failed run, choose the checkpoint, keep bad nodes out,
re-plan and print (or, with ``--execute``, carry out) the relaunch.

``recover`` is a group whose default command takes the run directory, so ``mscale recover RUN``
and ``mscale recover supervise -- CMD ...`` (added by `mscale.cli.recover_supervise`) both parse:
a first word that is not a subcommand, or that is an existing run directory and is not followed by
``--``, goes to ``diagnose`` (``mscale recover diagnose RUN`` names it explicitly; ``./supervise``
also reaches a run directory called ``supervise``).
Exit 0 relaunchable, 1 degraded, 2 unrecoverable, 3 bad input (or a relaunch that failed, or
a run directory a live job holds: `mscale.recover.liveness`); with ``--execute``, a job relaunched
in this process's place ends recover with its own code (0 when it trained to the end).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import typer
from typer.core import TyperGroup

from mscale.cli.app import HELP_OPTION_NAMES, app
from mscale.errors import EXIT_BAD_INPUT
from mscale.recover.decision import Verify

DEFAULT_COMMAND = "diagnose"


class DefaultCommandGroup(TyperGroup):
    """A group that sends its first word to ``diagnose`` unless it names a subcommand (and is not
    a run directory given without ``--``: ``mscale recover runs/x`` where ``x`` is
    ``supervise``)."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        from mscale.runs.rundir import looks_like_run_dir

        if args and args[0] not in HELP_OPTION_NAMES and (
                args[0] not in self.commands or (looks_like_run_dir(args[0]) and "--" not in args)):
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


RELAUNCH_ENDS = {
    0: "it trained to the end",
    1: "stopped early on request (a halt or a stop signal)",
    2: "stopped on a NaN/Inf loss",
    3: "failed",
    130: "interrupted",
}
"""What train's own exit codes (docs/train.md, "Exit codes") say about the relaunched job."""


SUBMITTERS = ("sbatch", "scontrol")
"""Relaunch commands that queue the job and return: their exit code is the submission's, not
the job's (which runs on, and ends later)."""


def submits(command: list[str]) -> bool:
    return bool(command) and os.path.basename(command[0]) in SUBMITTERS


def relaunch_exit_code(rc: int, command: list[str]) -> int:
    """The job's own code when the command ran the job and the code is one of train's, so that
    a halt on request (1) reads as one, not as a failure of recover; killed by SIGINT is 130
    (`contract_code`); 3 for anything else (a failed submission, another signal's -N, a
    launcher's 255)."""
    from mscale.recover.child import contract_code

    code = rc if submits(command) else contract_code(rc)
    return code if code in RELAUNCH_ENDS and not submits(command) else EXIT_BAD_INPUT


def relaunch_end_text(rc: int, command: list[str]) -> str:
    if submits(command):
        return (f"the relaunch command ({os.path.basename(command[0])}) failed with code {rc}: "
                "its own output above says why")
    what = RELAUNCH_ENDS.get(rc)
    if rc == -signal.SIGINT:
        return "the relaunched job was killed by SIGINT: interrupted (Ctrl-C)"
    if what is None:
        what = f"killed by signal {-rc}" if rc < 0 else "ended abnormally"
    return f"the relaunched job exited with code {rc}: {what}"


recover_app = typer.Typer(
    cls=DefaultCommandGroup, no_args_is_help=True, add_completion=False,
    context_settings={"help_option_names": HELP_OPTION_NAMES},
    help="Recover a failed run: `mscale recover RUN_DIR` (dry run; --execute to act; every "
         "option: `mscale recover diagnose --help`), or `mscale recover supervise -- LAUNCH "
         "COMMAND...`. Exit 0 relaunchable, 1 degraded, 2 unrecoverable, 3 bad input.")
app.add_typer(recover_app, name="recover")


@recover_app.command(DEFAULT_COMMAND)
def recover_cmd(
    run_dir: str = typer.Argument(..., help="Run directory of the failed job (path or URL)."),
    execute: bool = typer.Option(False, "--execute", help="Act: write the new plan, the data "
                                 "skip, the checkpoint pin, the decision and event, then "
                                 "relaunch. Default: print the plan, write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
    allow_batch_change: bool = typer.Option(False, "--allow-batch-change", help="Let the "
                                            "re-plan change the global batch when no layout "
                                            "keeps it on the remaining nodes."),
    no_recheck: bool = typer.Option(False, "--no-recheck", help="Do not re-check suspect nodes "
                                    "with preflight; the evidence alone decides."),
    verify: Verify = typer.Option("quick", "--verify", help="Checkpoint verification: quick "
                                  "(manifest, commit marker, sizes) or full (every chunk's crc)."),
    wait: float = typer.Option(0.0, "--wait", min=0.0, metavar="SECONDS", help="Wait up to "
                               "this long for a job still holding the run directory to let it "
                               "go (one that died on another host holds it until its lease "
                               "runs out); default: refuse a run in use at once (exit 3)."),
) -> None:
    """Diagnose the run's failure and print the relaunch plan (the default command). A run a
    live job holds (its lock.json) is refused with one line, exit 3, nothing written."""
    from mscale.recover.attempt_end import halted_on_request
    from mscale.recover.decide import (RecoverOptions, apply_plan, check_run_dir, launch,
                                       plan_recovery)
    from mscale.recover.liveness import wait_until_free
    from mscale.recover.relaunch import by_hand
    from mscale.runs.rundir import RunDir
    from mscale.recover.report import NEXT_BY_HAND, exit_code, render

    opts = RecoverOptions(execute=execute, allow_batch_change=allow_batch_change,
                          recheck=not no_recheck, verify=verify)
    if wait > 0:
        check_run_dir(run_dir)
        wait_until_free(run_dir, wait)  # still held after it: plan_recovery refuses
    plan = plan_recovery(run_dir, opts)
    # by hand, --execute has nothing to run: 3, so that a script does not read 0/1 as "the job
    # is back" (a batch job SLURM has queued again has no command either, and is back: its
    # verdict stands); the report's header says the same code
    code, decision, rc = exit_code(plan, execute), None, None
    if execute:
        decision = apply_plan(plan)
    if not as_json:
        sys.stdout.write(render(plan, executed=execute, decision=decision))
        sys.stdout.flush()
    # the reason lines go to stderr with --json too: stdout holds the document alone, and a
    # CI log or an operator still reads why nothing ran or how the relaunch ended
    if execute and by_hand(plan):
        sys.stderr.write(f"recover: nothing relaunched: the run recorded no launch command; "
                         f"{NEXT_BY_HAND}\n")
    if execute and plan.command:
        launched = time.time()
        rc = launch(plan, stdout=2 if as_json else None)  # fd 2: stdout holds the document
        if rc == 1 and not submits(plan.command) and not halted_on_request(
                RunDir(plan.run_dir), launched):
            rc_said = "1 without a halt recorded by train (torchrun exits 1 for any failure)"
            code = EXIT_BAD_INPUT
            sys.stderr.write(f"recover: the relaunched job exited with code {rc_said}: failed\n")
        elif rc != 0 or not submits(plan.command):  # a job run here: its end is the answer
            code = relaunch_exit_code(rc, plan.command)
            sys.stderr.write(f"recover: {relaunch_end_text(rc, plan.command)}\n")
    if as_json:
        from mscale.cli.output import print_json

        print_json({**plan.to_json(), "decision": decision, "launch_exit_code": rc,
                    "exit_code": code})
    raise typer.Exit(code)
