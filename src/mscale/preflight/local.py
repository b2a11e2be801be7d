"""``mscale preflight PLAN --local N``: N worker processes on this machine, then the report.

The workers are the same ``mscale preflight`` command with torchrun-style variables
(`mscale.distributed.launch.run_local_workers`, train's launcher), ranks grouped into "nodes" of
the plan's gpus_per_node. Rank 0 writes ``preflight.json``; this process prints it and exits
with its Nagios code. If a worker dies before rank 0 could write a report, the launcher, which
knows who died first, writes one that names that rank's node, unless the operator stopped the job
(Ctrl-C: no verdict, exit 130). While the workers start, stderr
shows how many have imported torch and the CLI (distributed/startup.py `StartupView`); rank 0's
own phase lines follow.

The workers' stdout and stderr go to ``RUN_DIR/logs/preflight/rank<N>.log`` (with train's
launcher's ``rank<N>.startup`` and ``rank<N>.pid`` beside them; `log_dir_for`), rewritten by the
next preflight into the same run directory, as train rewrites ``logs/rank<N>.log``. Not
``logs/`` itself: a preflight run after a failed training attempt (recover re-checks nodes with
a preflight.json newer than the failure) must not overwrite the attempt's rank logs that
``mscale recover`` reads. A remote run directory (an fsspec URL) cannot hold a process's stdout:
the logs then go to a local temporary directory, removed when the preflight passes, kept and
named on stderr when it does not (`launch_local`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult, PreflightReport
from mscale.distributed.launch import CLI_PRELOAD, run_local_workers, worker_log_dir
from mscale.distributed.stops import ended_by_stop
from mscale.errors import EXIT_INTERRUPTED
from mscale.preflight import judge
from mscale.preflight.report import finish, publish, say_written
from mscale.preflight.table import render
from mscale.preflight.options import OPTIONS_ENV, PreflightOptions
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir
from mscale.topology.placement import placement_for


def worker_args(plan_path: str, opts: PreflightOptions) -> list[str]:
    """The command line every worker runs; its options come whole through `OPTIONS_ENV`."""
    return ["preflight", plan_path if "://" in plan_path else os.path.abspath(plan_path),
            "--run-dir", opts.run_dir]


def worker_env(opts: PreflightOptions, logs: str) -> dict[str, str]:
    """What a worker finds in its environment: the launcher's options (minus --json: the
    launcher prints the document) and where the workers' logs are."""
    as_worker = opts.model_copy(update={"as_json": False})
    return {OPTIONS_ENV: as_worker.model_dump_json(), "MSCALE_PREFLIGHT_LOGS": logs}


def _fresh_report(run_dir: str, since: float) -> PreflightReport | None:
    from mscale.config.base import load_model

    path = RunDir(run_dir).preflight
    fs, p = fs_and_path(path)
    if not fs.isfile(p):
        return None
    report = load_model(PreflightReport, path)
    return report if report.time >= since else None


WORKER_PRELOAD = CLI_PRELOAD + ("mscale.preflight.runner",)
"""What the fork server imports before it forks the workers: the CLI's modules and the checks'
(`CLI_PRELOAD`: never ``mscale.cli.main``, the module ``python -m`` may run the launcher as)."""


LOGS_SUBDIR = "preflight"
"""The folder of ``RUN_DIR/logs`` that holds preflight's worker logs (module docstring)."""


def log_dir_for(run_dir: str) -> tuple[str, bool]:
    """Where the workers' logs go, and whether that is a temporary directory: a local run
    directory keeps them in ``RUN_DIR/logs/preflight``; any other URL gets a new local temporary
    directory (`mscale.distributed.launch.worker_log_dir`, as train's launcher)."""
    return worker_log_dir(run_dir, "logs", LOGS_SUBDIR)


def launch_local(plan_path: str, plan: Plan, opts: PreflightOptions, nprocs: int) -> int:
    """Run the preflight job on ``nprocs`` local processes; returns the report's exit code."""
    logs, temporary = log_dir_for(opts.run_dir)
    passed = False
    try:
        code, worker_failed = _run(plan_path, plan, opts, nprocs, logs, temporary)
        passed = code == 0 and not worker_failed
        return code
    finally:
        if temporary:
            if passed:
                shutil.rmtree(logs, ignore_errors=True)
            else:
                print(f"preflight: worker logs kept in {logs}", file=sys.stderr, flush=True)


def _run(plan_path: str, plan: Plan, opts: PreflightOptions, nprocs: int, logs: str,
         temporary: bool) -> tuple[int, bool]:
    """Start the workers and print the report: (exit code, whether a worker ended abnormally)."""
    started = time.time()
    lo = plan.layout  # stdout carries the report: the launcher's lines go to stderr, as rank 0's
    where = f"{logs} (temporary: removed if the preflight passes)" if temporary else logs
    print(f"preflight: starting {nprocs} workers on this machine (tp {lo.tp} x pp {lo.pp} x dp "
          f"{lo.dp}); worker logs in {where}", file=sys.stderr, flush=True)
    result = run_local_workers(nprocs, plan.cluster.gpus_per_node, worker_args(plan_path, opts),
                               logs, worker_env(opts, logs), rank0_to_stderr=True,
                               preload=WORKER_PRELOAD,
                               rank0_ends_job=True, node_names=plan.cluster.node_names())
    report = _fresh_report(opts.run_dir, started)
    unfinished = report is None or (result.failed_rank is not None and report.status == "UNKNOWN")
    stopped = result.stop_signal is not None and all(
        ended_by_stop(c, result.forced) for c in result.returncodes)
    if unfinished and stopped:
        # the operator stopped it: the workers that ended are no evidence against their nodes
        print(f"preflight: interrupted ({result.stop_signal}) before it finished: no verdict, "
              "no report written", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED, True
    if unfinished:
        report = _launcher_report(plan, opts, nprocs, result, logs, partial=report)
        publish(report, opts, quiet=True)
    render(report, opts.as_json)
    say_written(opts, since=started)
    return judge.exit_code(report.status), result.failed_rank is not None


def _launcher_report(plan: Plan, opts: PreflightOptions, nprocs: int, result, logs: str,
                     partial: PreflightReport | None = None):
    """No verdict from rank 0: name the first worker that died, and the ones still running,
    keeping what rank 0's own report (``partial``) holds of what was measured before."""
    names = plan.cluster.node_names()
    placement = placement_for(plan)
    node = lambda r: names[placement.node(r)]  # noqa: E731
    # rank 0's figures stay; its guesses at who failed give way to what the launcher saw
    results = [r for r in (partial.results if partial else [])
               if r.check not in ("rank_alive", "quarantine")]
    first = result.failed_rank
    if first is not None:
        code = result.returncodes[first]
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        results.append(CheckResult(
            check="rank_alive", entity_kind="rank", entity=f"rank {first}", node=node(first),
            ranks=[first], status="CRITICAL", expected="runs to the end",
            message=f"rank {first} {how} first; worker logs in {logs}"))
        results += [CheckResult(
            check="rank_alive", entity_kind="rank", entity=f"rank {r}", node=node(r), ranks=[r],
            status="CRITICAL", expected="answers within the timeout",
            message="stopped (SIGSTOP) when the job failed: hung") for r in result.stopped_at_failure]
    else:
        results.append(CheckResult(check="rank_alive", entity_kind="job", entity="job",
                                   status="UNKNOWN", expected="rank 0 writes the report",
                                   message=f"no report was written; worker logs in {logs}"))
    report = finish(plan, opts, nprocs, results, {r: node(r) for r in range(nprocs)})
    if partial:
        report.measured, report.judging = partial.measured, partial.judging
    return report
