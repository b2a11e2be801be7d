"""Start N local worker processes of one `mscale` command and watch them to the end (``--local``).

Shared by ``train --local`` and ``preflight --local``, which sit side by side above this layer.
What the watch decides (the first abnormal end is the job's failure; the hung ranks it waited
for) is distributed/watcher.py; the rendezvous port, distributed/ports.py. Start-up is shown
while it lasts: the workers' phase markers and the view of them are distributed/startup.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from mscale.distributed import forkserver
from mscale.distributed.lifeline import LIFELINE_ENV, LOG_FILE_ENV, Lifeline
from mscale.distributed.startup import PHASE_FILE_ENV, StartupView, phase_file, read_phases
from mscale.distributed.ports import free_port
from mscale.distributed.stdio import guard_std_streams
from mscale.distributed.stops import Notice, StopRequests, forwarded_signals, generic_notice
from mscale.distributed.watcher import (GRACE_S, JobResult, describe_exit, first_failed,
                                        watch_workers)
from mscale.errors import MscaleError

if TYPE_CHECKING:
    from mscale.config.plan import Plan

CLI_ENTRY = ("import sys, torch, mscale.cli.main as cli; "
             "from mscale.distributed.startup import mark_phase; "
             "from mscale.distributed.lifeline import watch_launcher; watch_launcher(); "
             "mark_phase('imported'); sys.argv[0] = 'mscale'; cli.main()")
"""``python -c`` code of a worker that runs an ``mscale`` command (its arguments follow): torch
and the CLI imported, the launcher watched (distributed/lifeline.py: the worker stops if the
launcher is gone), the ``imported`` phase marked, then the command. Every worker imports torch
anyway; importing it first makes the marker mean "the expensive part is done"."""

CLI_PRELOAD = ("torch", "mscale.cli.app", "mscale.cli.output")
"""What the fork server imports for `CLI_ENTRY` workers (distributed/forkserver.py); a command
adds its own modules (preflight/local.py). What ``mscale.cli.main`` runs, never that module
itself: before a forked worker runs its entry, multiprocessing re-runs the launcher's
``__main__`` in it (``runpy``, as ``__mp_main__``), and a launcher started as ``python -m
mscale.cli.main`` whose module the server had imported printed runpy's "found in sys.modules"
RuntimeWarning once per worker on the console. The entry imports the module itself (a few ms)."""

CLI_PHASES: tuple[tuple[str, str], ...] = (("imported", "imported"),)
"""The phases a `CLI_ENTRY` worker marks, as (marker, label), in order."""


def check_local_count(local: int, plan: "Plan", plan_path: str) -> None:
    """``--local N`` must start the plan's world size. A GPU plan of several nodes is not for one
    machine: its fix names srun and torchrun, not ``--local 12288`` (12,288 processes here)."""
    world = plan.layout.world_size
    if local == world:
        return
    nodes = -(-world // plan.cluster.gpus_per_node)
    on_gpus = not plan.cluster.gpu.is_cpu  # --local emulates a CPU plan's nodes
    fix = (f"run it on its {nodes} nodes under srun or torchrun (docs/slurm.md), or plan for "
           f"{local} processes" if on_gpus and nodes > 1 else
           f"use --local {world}, or plan for {local} processes")
    raise MscaleError(f"--local {local} but the plan's layout needs {world} processes",
                      file=plan_path, field="layout", fix=fix)


def worker_log_dir(run_dir: str, *parts: str) -> tuple[str, bool]:
    """Where local workers' stdout and stderr go, and whether that is a temporary directory:
    ``RUN_DIR/<parts...>`` for a local run directory (a path or a ``file://`` URL); for any other
    URL a new local temporary directory, since an object store cannot be a process's stdout (the
    caller removes it when the job succeeded and names it when it did not)."""
    if "://" not in run_dir or run_dir.startswith("file://"):
        return os.path.join(run_dir.removeprefix("file://"), *parts), False
    import tempfile

    return tempfile.mkdtemp(prefix="mscale-logs-"), True


def pid_file(log_dir: str, rank: int) -> str:
    """``logs/rank<N>.pid``: the process id of worker N, written by the launcher when it starts
    it. A forked worker's /proc/PID/environ is the fork server's (the kernel shows the
    environment a process was exec'd with), so this, not RANK, is how to find a rank's process."""
    return os.path.join(log_dir, f"rank{rank}.pid")


def _tee(pipe, write: Callable[[str], None], log, said: list[str]) -> None:
    """Copy rank 0's output to the console and to its log file, line by line, until rank 0 ends;
    ``said`` keeps its last line (`JobResult.rank0_last_line`).

    Neither copy may stop the draining: a tee that died would leave rank 0 blocked on a full
    pipe. The console is best-effort (distributed/stdio.py: a closed terminal only loses its
    view); a log write that fails is reported once on the console and the draining goes on."""
    log_ok = True
    for line in iter(pipe.readline, b""):
        said[:] = [line.decode(errors="replace").rstrip("\n")]
        if log_ok:
            try:
                log.write(line)
                log.flush()
            except (OSError, ValueError) as e:
                log_ok = False
                _best_effort(write, f"warning: rank 0's log could not be written ({e}); its "
                             "output goes on to the console only\n")
        _best_effort(write, line.decode(errors="replace"))


def _best_effort(write: Callable[[str], None], text: str) -> None:
    try:
        write(text)
    except (OSError, ValueError):  # the console is closed: the log has the line
        pass


NODE_ENV = "MSCALE_NODE"
"""A local worker's pretend node name (`run_local_workers`)."""


@dataclass
class LocalJob:
    """One ``--local`` job: what each worker runs and how the launcher shows and watches it."""

    nprocs: int
    gpus_per_node: int
    worker_args: list[str]
    """Arguments after ``python -c ENTRY`` (for `CLI_ENTRY`: the ``mscale`` command line)."""
    log_dir: str
    extra_env: dict[str, str]
    rank0_to_stderr: bool = False
    """Rank 0's output goes to stderr (the command's stdout is a document, e.g. ``--json``)."""
    rank0_ends_job: bool = False
    """Once rank 0 has exited 0 (it wrote the job's result, as preflight's does), the workers
    still running are stopped: a hung one would otherwise hold the launcher."""
    entry: str = CLI_ENTRY
    phases: Sequence[tuple[str, str]] = CLI_PHASES
    """The start-up phases the workers mark, shown until all of them reached the last."""
    node_names: Sequence[str] = ()
    """The pretend node of each group of ``gpus_per_node`` ranks, given to its workers as
    ``MSCALE_NODE`` (what ``SLURMD_NODENAME`` is under SLURM): tools outside mscale, such as a
    fault injected into one node, can select a node's processes by it."""
    preload: Sequence[str] = CLI_PRELOAD
    stop_notice: Notice = generic_notice
    """The console line for the operator's first stop signal (distributed/stops.py)."""
    abandon: Callable[[], str | None] | None = None
    """Asked at every poll: a reason to kill the workers at once, without a checkpoint (train:
    the run directory's lock was taken over by another job, so two must not write it)."""


def run_local_workers(nprocs: int, gpus_per_node: int, worker_args: list[str], log_dir: str,
                      extra_env: dict[str, str], **settings) -> JobResult:
    """Run ``python -c ENTRY <worker_args>`` (by default ``mscale <worker_args>``) on ``nprocs``
    local processes and watch them to the end; ``settings``: the other fields of `LocalJob`.
    The processes are forks of one server that imported ``preload`` (torch, the entry's
    modules) once (distributed/forkserver.py).

    The operator's stop signals are distributed/stops.py: the first (SIGINT, SIGTERM, SIGHUP
    unless ignored) is passed to the workers as SIGTERM, a second Ctrl-C kills them. The workers
    get the launcher's lifeline (distributed/lifeline.py): an entry that calls
    ``watch_launcher()`` stops if the launcher dies. The console is best-effort while the job
    runs (distributed/stdio.py).
    """
    job = LocalJob(nprocs, gpus_per_node, worker_args, log_dir, extra_env, **settings)
    os.makedirs(log_dir, exist_ok=True)
    lifeline = Lifeline(backlog=nprocs + 8)
    restore_streams = guard_std_streams()
    try:
        return _run_workers(job, lifeline)
    finally:
        restore_streams()
        lifeline.close()


def _run_workers(job: LocalJob, lifeline: Lifeline) -> JobResult:
    out = sys.stderr if job.rank0_to_stderr else sys.stdout
    view = StartupView(job.nprocs, job.phases, out,
                       lambda r: read_phases(phase_file(job.log_dir, r)))
    procs: list = []
    logs: list = []
    tees: list[threading.Thread] = []
    stops = StopRequests(procs, job.stop_notice, tell=lifeline.tell_stop)
    rank0_said: list[str] = []
    result: JobResult | None = None

    first_end_judged = []

    abandoned: list[str] = []

    def on_poll(codes: list[int | None]) -> None:
        lifeline.accept()  # the workers' connections, held open until the launcher ends
        why = job.abandon() if job.abandon is not None and not abandoned else None
        if why:
            abandoned.append(why)
            view.line(f"stopping the workers now, without a checkpoint: {why}\n")
            for p in procs:
                if p.poll() is None:
                    p.kill()
        stops.deliver()
        for note in stops.take_notes():
            view.line(note + "\n")
        if any(c is not None for c in codes):
            # the workers whose collectives fail next ask whether the launcher is gone too:
            # it is not, and says so (distributed/lifeline.py), so none waits to be sure
            lifeline.tell_alive()
            view.close()  # a worker ended: what follows is about that, not the start
            if not first_end_judged:  # once, at the first end seen, before `watch_workers` signals
                first_end_judged.append(True)  # any worker (its SIGTERMs, its SIGKILLs)
                # a worker killed by a signal (SIGKILL, SIGSEGV) failed: no agreed stop (every
                # rank exiting 3 at a full disk) ends that way; an operator's stop has its line
                if (stops.first is None and not job.rank0_ends_job
                        and any(c is not None and c < 0 for c in codes)):
                    view.line(failure_seen_line(job, codes) + "\n")
        else:
            view.poll()

    signals = forwarded_signals()
    old = {s: signal.signal(s, stops.handler) for s in signals}
    try:
        # this thread is busy starting them: the view draws itself
        with _sighup_blocked(signals), view.ticking():
            _start(job, procs, logs, tees, view, lifeline, rank0_said)
        stops.deliver()  # a stop asked for while workers were still starting reaches them all
        result = watch_workers(procs, job.rank0_ends_job, on_poll)
        result.abandoned = abandoned[0] if abandoned else None
        view.close()
        for note in stops.take_notes():  # a kill ends the watching before its next poll
            view.line(note + "\n")
        if stops.first is not None and (result.failed_at is None
                                        or stops.first_at < result.failed_at):
            result.stop_signal, result.forced = stops.first_name, stops.forced
        return result
    finally:
        view.close()
        for s, h in old.items():
            signal.signal(s, h)
        for t in tees:
            t.join(timeout=5)
        if result is not None and rank0_said:
            result.rank0_last_line = rank0_said[0]
        for log in logs:
            log.close()


@contextmanager
def _sighup_blocked(signals: Sequence[int]) -> Iterator[None]:
    """SIGHUP blocked on this thread for the body (when it is among the forwarded ``signals``).

    A closed terminal sends SIGHUP to its whole foreground process group: the fork server and
    multiprocessing's resource tracker, started here, would die of it (the workers' exit codes
    are read through the server; the tracker's loss spills tracebacks into every log). Started
    while this thread blocks SIGHUP, they and the workers forked from the server keep it blocked
    (a mask survives fork and exec; a handler does not). The launcher itself has its handler: a
    hangup during the start is forwarded, not lost."""
    shielded = {signal.SIGHUP} & set(signals) if hasattr(signal, "pthread_sigmask") else set()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, shielded) if shielded else None
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start(job: LocalJob, procs: list, logs: list, tees: list, view: StartupView,
           lifeline: Lifeline, rank0_said: list[str]) -> None:
    """Start the workers, each appended to ``procs`` (its log to ``logs``, rank 0's tee to
    ``tees``) as it starts: a failure half-way leaves the started ones to the caller (whose
    lifeline, closed, stops them)."""
    port = free_port()
    threads = str(max(1, (os.cpu_count() or 1) // job.nprocs))
    for rank in range(job.nprocs):  # a previous attempt's markers go before the view reads any
        open(phase_file(job.log_dir, rank), "w", encoding="utf-8").close()
    for rank in range(job.nprocs):
        env = _worker_env(job, rank, port, threads, lifeline.address)
        with open(env[PHASE_FILE_ENV], "w", encoding="utf-8") as f:
            f.write(f"spawned {time.time():.3f}\n")
        # appending: rank 0 adds lines to its log itself (lifeline.say_in_log) while the tee
        # writes its output; at the tee's own offset each write went over those lines
        log = os.fdopen(os.open(env[LOG_FILE_ENV], os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                | os.O_APPEND, 0o644), "wb")
        logs.append(log)
        if rank == 0:  # its output goes to the console too: through a pipe the launcher tees
            read_end, write_end = os.pipe()
            procs.append(forkserver.start(job.entry, job.worker_args, env, write_end,
                                          job.preload))
            os.close(write_end)
            pipe = os.fdopen(read_end, "rb")
            logs.append(pipe)  # closed with the logs
            t = threading.Thread(target=_tee, args=(pipe, view.line, log, rank0_said),
                                 daemon=True)
            t.start()
            tees.append(t)
        else:
            procs.append(forkserver.start(job.entry, job.worker_args, env, log.fileno(),
                                          job.preload))
        with open(pid_file(job.log_dir, rank), "w", encoding="utf-8") as f:
            f.write(f"{procs[-1].pid}\n")


def _worker_env(job: LocalJob, rank: int, port: int, threads: str,
                lifeline: str) -> dict[str, str]:
    """Worker ``rank``'s environment: torch.distributed's rendezvous variables, as torchrun sets
    them, and the launcher's own (phase markers, lifeline, log file, pretend node)."""
    per_node = job.gpus_per_node
    env = dict(os.environ, **job.extra_env, RANK=str(rank), WORLD_SIZE=str(job.nprocs),
               LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(min(per_node, job.nprocs)),
               GROUP_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), MSCALE_LAUNCHER="local",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads),
               **{PHASE_FILE_ENV: phase_file(job.log_dir, rank), LIFELINE_ENV: lifeline,
                  LOG_FILE_ENV: os.path.abspath(os.path.join(job.log_dir, f"rank{rank}.log"))})
    if rank // per_node < len(job.node_names):
        env[NODE_ENV] = job.node_names[rank // per_node]
    return env


def failure_seen_line(job: LocalJob, codes: list[int | None]) -> str:
    """Said the moment a worker is seen killed: the others then take seconds to stop (each
    writes what it saw of its peer's end) before the job's closing line, and the console was
    silent meanwhile."""
    rank = first_failed(codes)
    node = (f" on {job.node_names[rank // job.gpus_per_node]}"
            if len(job.node_names) > rank // job.gpus_per_node else "")
    return (f"rank {rank}{node} {describe_exit(codes[rank])}; stopping the other workers "
            f"(they record what they saw first, up to {GRACE_S:.0f} s)")
