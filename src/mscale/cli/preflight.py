"""``mscale preflight``: check the cluster on the plan's exact groups; name the bad nodes.

Exit codes follow Nagios: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN or bad input.
"""

from __future__ import annotations

import os

import typer

from mscale.cli.app import app
from mscale.cli.options import build as build_options
from mscale.cli.options import with_flags
from mscale.preflight.options import PreflightOptions


@app.command("preflight")
@with_flags(PreflightOptions)
def preflight_cmd(
    plan: str = typer.Argument(..., help="Plan file from `mscale plan`: its groups are tested."),
    run_dir: str = typer.Option(..., "--run-dir", help="Run directory (path or fsspec URL); "
                                "preflight.json is written there."),
    local: int = typer.Option(0, "--local", min=0, help="Start this many worker processes on "
                              "this machine (must equal the plan's world size)."),
    **flags,
) -> None:
    """Check the cluster before a run. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN/bad input."""
    # every flag in **flags is a field of PreflightOptions, help = its docstring
    from mscale.preflight.host import check_inputs_here
    from mscale.preflight.options import options_from_env
    from mscale.runs.rundir import RunDir
    from mscale.runs.targets import check_lasting, check_not_an_input, check_output
    from mscale.topology.placement import load_checked_plan

    opts = options_from_env() or build_options(PreflightOptions, flags, run_dir=run_dir,
                                               plan_path=plan)
    prometheus, sysfs_root, storage_url = opts.prometheus, opts.sysfs_root, opts.storage_url
    resolved = load_checked_plan(plan)
    check_lasting(run_dir, "--run-dir")
    check_output(run_dir, "dir", "--run-dir")
    if prometheus:
        check_lasting(prometheus, "--prometheus")
        run = RunDir(run_dir)  # what preflight and recover read there, and the plan
        check_not_an_input(prometheus, "--prometheus", [
            ("plan", plan), ("run directory's preflight.json", run.preflight),
            ("run directory's quarantine.json", run.quarantine)])
        check_output(prometheus, "file", "--prometheus", example="preflight.prom")
    check_inputs_here(run_dir, sysfs_root=sysfs_root, storage_url=storage_url)
    if local:
        from mscale.distributed.launch import check_local_count

        check_local_count(local, resolved, plan)
    from mscale.cli.app import STATE

    if STATE["debug"]:
        os.environ["MSCALE_DEBUG"] = "1"
    if local:
        from mscale.preflight.local import launch_local

        raise typer.Exit(launch_local(plan, resolved, opts, local))
    from mscale.preflight.runner import run_preflight_worker  # imports torch: workers only

    run_preflight_worker(resolved, opts)

