"""One process of a training job, from the launcher's environment to its exit code.

This is the worker's edge: whatever happens inside, the process ends with a contract exit code
(0 done, 1 stopped on request, 2 NaN/Inf, 3 bad input or crashed, 130 interrupted by a second
Ctrl-C), and a failure leaves one line
on stderr and ``logs/rank<N>.error.json`` (train/failure.py) for `recover`. It never exits 1 for
a crash: 1 means "stopped early on request", which recover treats as resumable without repair.

Two things around the job are not allowed to end it, or to outlive it:

- the console: ``sys.stdout``/``sys.stderr`` are best-effort (distributed/stdio.py), so a
  closed terminal or a gone reader costs the view, not the run;
- the ``--local`` launcher: a worker watches it (distributed/lifeline.py) and, when it is gone,
  stops at once with one line in its log, an error file of kind ``launcher_died`` and (rank 0)
  a ``stop`` event, then exits 3. A collective that fails because a peer already stopped that
  way is the same story, not a network fault: the edge waits a moment for its own watch to
  confirm it (`LAUNCHER_CONFIRM_S`).
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
from mscale.train.failure import ReportedFailure, classify, report_failure
from mscale.train.options import TrainOptions

LAUNCHER_CONFIRM_S = 2.0
"""How long a failing ``--local`` worker whose failure looks like a lost peer (network, timeout,
console) waits for its launcher watch before reporting the failure as its own: the launcher's
death wakes every worker's watch at once, but a peer that stopped a moment earlier breaks this
worker's collective first. A living launcher that has seen a worker end says so at once
(`Lifeline.tell_alive`), so the wait is this long only when nobody answers."""

LOST_PEER_KINDS = ("network", "timeout", "console")


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
    from mscale.distributed.startup import mark_phase
    from mscale.distributed.lifeline import watch_launcher
    from mscale.distributed.stdio import guard_std_streams
    from mscale.train.loop import train

    guard_std_streams()  # the console is a view: a closed one never stops training
    mark_phase("imported")  # torch and the engine's modules: most of a worker's start-up
    env = env or read_launch_env(command="train", world=plan.layout.world_size)
    run = RunDir(options.run_dir)
    # the node as the launcher and the plan name it (node3 under --local), not this host's name:
    # the launcher's failure line, watch, quarantine and recover all use that name
    rank, node = env.rank, node_name(env, plan)
    # --local only (None under torchrun/srun): stop as soon as the launcher is gone
    watch = watch_launcher(lambda why: launcher_gone(run, rank, node, why))
    try:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(default_threads(env.local_world_size))
        code = train(plan, options, env)
    except BaseException as exc:  # noqa: BLE001 - the edge: every failure becomes a contract code
        # say why before anything ends this process: a --local launcher SIGTERMs every worker
        # as soon as one fails, and a peer told of this rank's error may exit first (rank 0's
        # failed start: its line and error file were lost under load). Ignored process-wide:
        # blocking it in this thread alone let another thread (lock heartbeat, data read-ahead,
        # gloo) take the signal and die with it; the launcher still SIGKILLs after its grace.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if launcher_took_it(watch, exc):
            _wait_for_exit()  # the watch's thread is reporting the launcher's death, then exits
        code = exc.code if isinstance(exc, ReportedFailure) else report_failure(run, rank, node,
                                                                                 exc)
        shutdown_and_exit(code, barrier=False)
    # a clean exit synchronises all ranks; after a failure peers may be gone, so no barrier
    shutdown_and_exit(code, barrier=code in (0, 1, 2))


def launcher_took_it(watch, exc: BaseException) -> bool:
    """Whether ``exc`` is this worker's share of its launcher's death: any failure once the
    launcher watch has fired (its thread is already reporting; a second report from here would
    race it and could cut off rank 0's stop event), or a lost peer (network, timeout, console)
    while the watch says, within `LAUNCHER_CONFIRM_S`, that the launcher is gone. Then the
    watch's own report stands, not a network fault or crash of this rank."""
    if watch is None or isinstance(exc, ReportedFailure):
        return False
    if watch.gone.is_set():
        return True
    return classify(exc) in LOST_PEER_KINDS and watch.wait_gone(LAUNCHER_CONFIRM_S)


def launcher_gone(run: RunDir, rank: int, node: str, why: str) -> None:
    """The ``--local`` launcher is gone (`watch_launcher`'s thread): say so in this rank's log,
    leave the error file (and on rank 0 the stop event) that recover reads, exit 3. Never
    returns."""
    from mscale.distributed.lifeline import stop_worker
    from mscale.train.failure import launcher_gone_line, record_launcher_gone

    stop_worker(launcher_gone_line(run, rank, node, why),
                report=lambda: record_launcher_gone(run, rank, node, why))


def _wait_for_exit() -> None:
    """Leave the process to the thread that is ending it (`launcher_gone`), with a bound."""
    import time

    from mscale.distributed.lifeline import EXIT_CODE, REPORT_DEADLINE_S

    time.sleep(REPORT_DEADLINE_S + 5)
    os._exit(EXIT_CODE)


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
