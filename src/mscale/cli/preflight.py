"""``mscale preflight``: check the cluster on the plan's exact groups; name the bad nodes.

Exit codes follow Nagios: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN or bad input.
"""

from __future__ import annotations

import os

import typer

from mscale.cli.app import app
from mscale.cli.output import parse_rank_values
from mscale.errors import MscaleError
from mscale.preflight.options import Level


def _parse_slow(values: list[str]) -> dict[int, float]:
    return parse_rank_values(values, "--inject-slow", "FACTOR", (1.0, 1e6), "5:4")


@app.command("preflight")
def preflight_cmd(
    plan: str = typer.Argument(..., help="Plan file from `mscale plan`: its groups are tested."),
    run_dir: str = typer.Option(..., "--run-dir", help="Run directory (path or fsspec URL); "
                                "preflight.json is written there."),
    local: int = typer.Option(0, "--local", min=0, help="Start this many worker processes on "
                              "this machine (must equal the plan's world size)."),
    level: Level = typer.Option("quick", "--level", help="quick (about a minute) or full."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds before a hung "
                                  "collective names the ranks that did not answer."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    prometheus: str = typer.Option(None, "--prometheus", help="Also write a Prometheus textfile."),
    sysfs_root: str = typer.Option("/sys", "--sysfs-root", help="Where to read InfiniBand ports "
                                   "from (a fixture tree in tests)."),
    storage_url: str = typer.Option(None, "--storage-url", help="Checkpoint storage to test "
                                    "(default: the run directory's ckpt/)."),
    inject_slow: list[str] = typer.Option([], "--inject-slow", hidden=True, help="Test hook "
                                          "RANK:FACTOR: that rank's timed GEMM, sends, receives "
                                          "and collectives take FACTOR times as long."),
) -> None:
    """Check the cluster before a run. Exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN/bad input."""
    from mscale.preflight.host import check_inputs_here
    from mscale.preflight.options import PreflightOptions
    from mscale.runs.targets import check_output
    from mscale.topology.placement import load_checked_plan

    opts = PreflightOptions(run_dir=run_dir, level=level, timeout_s=timeout,
                            inject_slow=_parse_slow(inject_slow), sysfs_root=sysfs_root,
                            storage_url=storage_url, plan_path=plan, as_json=as_json,
                            prometheus=prometheus)
    resolved = load_checked_plan(plan)
    check_output(run_dir, "dir", "--run-dir")
    if prometheus:
        check_output(prometheus, "file", "--prometheus")
    check_inputs_here(run_dir, sysfs_root=sysfs_root, storage_url=storage_url)
    world = resolved.layout.world_size
    if local and local != world:
        raise MscaleError(f"--local {local} but the plan's layout needs {world} processes",
                          file=plan, field="layout",
                          fix=f"use --local {world}, or plan for {local} processes")
    from mscale.cli.app import STATE

    if STATE["debug"]:
        os.environ["MSCALE_DEBUG"] = "1"
    if local:
        from mscale.preflight.local import launch_local

        raise typer.Exit(launch_local(plan, resolved, opts, local))
    from mscale.preflight.runner import run_preflight_worker  # imports torch: workers only

    run_preflight_worker(resolved, opts)

