"""One process of a training job, from the launcher's environment to its exit code.

This is the worker's edge: whatever happens inside, the process ends with a contract exit code
(0 done, 1 stopped on request, 2 NaN/Inf, 3 bad input or crashed), and a failure leaves one line
on stderr and ``logs/rank<N>.error.json`` (train/failure.py) for `recover`. It never exits 1 for
a crash: 1 means "stopped early on request", which recover treats as resumable without repair.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch

from mscale.config.plan import Plan
from mscale.errors import EXIT_BAD_INPUT
from mscale.runs.rundir import RunDir
from mscale.topology.env import LaunchEnv, node_name, read_launch_env
from mscale.train.failure import classify, one_line, write_error_file
from mscale.train.options import TrainOptions


def default_threads(local_world_size: int, cpus: int | None = None) -> int:
    """Intra-op threads per process when OMP_NUM_THREADS is unset: the node's cores shared by
    its processes. torch otherwise starts one thread per core in *every* process, and on CPUs N
    processes × all cores oversubscribe the machine (measured ~10x slower steps under srun)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, cpus // max(1, local_world_size))


def run_worker(plan: Plan, options: TrainOptions, env: LaunchEnv | None = None) -> None:
    """Run this process's share of the job and exit the process with its code (never returns).

    The launcher's environment is read first, outside the edge: without one there is no rank
    and no job, so the `NoLauncherError` is a usage error for the CLI to print like any other
    bad input (exit 3), not a failure of "rank -1 on <host>" with an error file.
    """
    from mscale.distributed.init import shutdown_and_exit
    from mscale.distributed.launch import mark_phase
    from mscale.train.loop import train

    mark_phase("imported")  # torch and the engine's modules: most of a worker's start-up
    env = env or read_launch_env(command="train", world=plan.layout.world_size)
    run = RunDir(options.run_dir)
    # the node as the launcher and the plan name it (node3 under --local), not this host's name:
    # the launcher's failure line, watch, quarantine and recover all use that name
    rank, node = env.rank, node_name(env, plan)
    try:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(default_threads(env.local_world_size))
        code = train(plan, options, env)
    except BaseException as exc:  # noqa: BLE001 - the edge: every failure becomes a contract code
        # say why before anything ends this process: a --local launcher SIGTERMs every worker
        # as soon as one fails, and a peer told of this rank's error may exit first (rank 0's
        # failed start: its line and error file were lost under load)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        code = _report_failure(run, rank, node, exc)
        shutdown_and_exit(code, barrier=False)
    # a clean exit synchronises all ranks; after a failure peers may be gone, so no barrier
    shutdown_and_exit(code, barrier=code in (0, 1, 2))


def _report_failure(run: RunDir, rank: int, node: str, exc: BaseException) -> int:
    """One line on stderr, the error file, and the exit code for ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        sys.stderr.write(f"rank {rank}: interrupted\n")
        return 130
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    kind = classify(exc)
    path = write_error_file(run, rank, node, exc) if rank >= 0 else None
    where = f"; details in {path}" if path else ""
    line = f"error (rank {rank} on {node}, {kind}): {one_line(exc)}{where}"
    if os.environ.get("MSCALE_DEBUG"):  # `mscale --debug train ...`
        traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.write(line + "\n")
    if rank == 0 and os.environ.get("MSCALE_LAUNCHER") != "local":  # --local's launcher does it
        _stop_event(run, rank, node, kind, line)
    # 3 for every failure: a damaged checkpoint's MscaleError carries verify's 2, which for
    # train would read as "NaN stop"
    return EXIT_BAD_INPUT


def _stop_event(run: RunDir, rank: int, node: str, kind: str, line: str) -> None:
    """Under srun/torchrun nobody else sees the job end: rank 0 records its own view."""
    from mscale.config.records import Event
    from mscale.train.session import run_id_from_env

    evidence = {"kind": kind, "error_file": f"logs/rank{rank}.error.json"}
    if any(os.environ.get(k) for k in ("MSCALE_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")):
        # recover scopes evidence to one attempt by run id, also one that failed before `start`
        evidence["run_id"] = run_id_from_env()
    try:
        run.append_record(run.events, Event(
            source="train", kind="hang" if kind == "timeout" else "stop", severity="critical",
            ranks=[rank], nodes=[node], message=line, evidence=evidence))
    except Exception:  # noqa: BLE001 - the console line above already says what happened
        sys.stderr.write(f"rank {rank}: the stop event could not be written to {run.events}\n")


def local_main(argv: list[str] | None = None) -> None:
    """A ``--local`` worker (train/launch.py `WORKER_ENTRY`; argv: the plan's path): the plan and
    the launcher's options, then `run_worker`, the same function ``mscale train`` runs under
    torchrun or srun. The launcher checked every input before it started this process, so the
    CLI's parsing and checks are not repeated here; an input that changed since (the plan file)
    still fails like the CLI fails: one ``error:`` line, exit 3."""
    from mscale.errors import MscaleError
    from mscale.topology.placement import load_checked_plan
    from mscale.train.launch import OPTIONS_ENV, options_from_env

    argv = sys.argv[1:] if argv is None else argv
    try:
        options = options_from_env()
        if options is None or len(argv) != 1:
            raise MscaleError("a --local worker needs the plan's path and the launcher's options",
                              field=OPTIONS_ENV, fix="start workers with `mscale train --local N`")
        plan = load_checked_plan(argv[0])
    except Exception as e:  # noqa: BLE001 - the worker's edge, before run_worker's own
        if os.environ.get("MSCALE_DEBUG"):
            traceback.print_exc()
        text = str(e) if isinstance(e, MscaleError) else f"{type(e).__name__}: {e}"
        sys.stderr.write(f"error: {text}\n")
        sys.exit(EXIT_BAD_INPUT)
    run_worker(plan, options)
