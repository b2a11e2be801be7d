"""Start N local worker processes of one `mscale` command and watch them to the end (``--local``).

Shared by ``train --local`` and ``preflight --local``, which sit side by side above this layer.
The watcher polls every 100 ms. The first worker to end abnormally (exit code 3, any other code
outside 0–2, or a signal) is the job's failure; the others are stopped. At that moment it also
notes which workers were still running and which were *stopped* (state ``T``: SIGSTOP, a
debugger): when the failure is a collective timeout, those are the hung ranks the others waited
for — the ones that never time out themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from mscale.errors import EXIT_BAD_INPUT

GRACE_S = 15.0
POLL_S = 0.1


@dataclass
class JobResult:
    """How a local job ended."""

    code: int
    """The job's contract exit code (0 done, 1 stopped on request, 2 NaN, 3 failed)."""
    returncodes: list[int | None]
    """Each worker's raw return code (negative: killed by that signal)."""
    failed_rank: int | None = None
    """The first worker to end abnormally; None when the job ended in agreement."""
    alive_at_failure: list[int] = field(default_factory=list)
    """Workers still running when the first failure was seen."""
    stopped_at_failure: list[int] = field(default_factory=list)
    """Of those, the ones whose process was stopped (SIGSTOP): certainly hung."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tee(pipe, out, log) -> None:
    """Copy rank 0's output to the console and to its log file, line by line."""
    for line in iter(pipe.readline, b""):
        log.write(line)
        log.flush()
        out.write(line.decode(errors="replace"))
        out.flush()


def run_local_workers(nprocs: int, gpus_per_node: int, worker_args: list[str], log_dir: str,
                      extra_env: dict[str, str], rank0_to_stderr: bool = False,
                      rank0_ends_job: bool = False) -> JobResult:
    """Run ``mscale <worker_args>`` on ``nprocs`` local processes and watch them to the end.

    ``rank0_ends_job``: once rank 0 has exited 0 (it wrote the job's result, as preflight's
    does), the workers still running are stopped: a hung one would otherwise hold the launcher.
    """
    os.makedirs(log_dir, exist_ok=True)
    port = _free_port()
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    procs, logs, tees = [], [], []
    for rank in range(nprocs):
        env = dict(os.environ, **extra_env, RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_RANK=str(rank % gpus_per_node),
                   LOCAL_WORLD_SIZE=str(min(gpus_per_node, nprocs)),
                   GROUP_RANK=str(rank // gpus_per_node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MSCALE_LAUNCHER="local",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "wb")
        logs.append(log)
        p = subprocess.Popen([sys.executable, "-m", "mscale.cli.main", *worker_args], env=env,
                             stdout=subprocess.PIPE if rank == 0 else log,
                             stderr=subprocess.STDOUT)
        procs.append(p)
        if rank == 0:
            out = sys.stderr if rank0_to_stderr else sys.stdout
            t = threading.Thread(target=_tee, args=(p.stdout, out, log), daemon=True)
            t.start()
            tees.append(t)

    def forward(signum, frame):  # noqa: ARG001
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs, rank0_ends_job)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in tees:
            t.join(timeout=5)
        for log in logs:
            log.close()


def _abnormal(code: int | None) -> bool:
    return code is not None and code not in (0, 1, 2)


def _first_failed(codes: list[int | None]) -> int:
    """The rank that failed first among those that ended abnormally. A signal beats an exit
    code: the peers of a killed rank exit 3 right after it, having lost their connection."""
    bad = [r for r, c in enumerate(codes) if _abnormal(c)]
    return min(bad, key=lambda r: (codes[r] >= 0, r))


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _watch(procs: list[subprocess.Popen], rank0_ends_job: bool = False) -> JobResult:
    result = JobResult(code=0, returncodes=[])
    ended_by_rank0 = False
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if deadline is None and rank0_ends_job and codes[0] == 0:
            ended_by_rank0, deadline = True, time.monotonic() + GRACE_S
            for p in procs[1:]:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        elif deadline is None and any(c not in (None, 0) for c in codes):
            bad = [r for r, c in enumerate(codes) if _abnormal(c)]
            if bad:
                result.failed_rank = _first_failed(codes)
                result.alive_at_failure = [r for r, c in enumerate(codes) if c is None]
                result.stopped_at_failure = [r for r in result.alive_at_failure
                                             if _is_stopped(procs[r].pid)]
            deadline = time.monotonic() + GRACE_S
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill() if r in result.stopped_at_failure else p.send_signal(signal.SIGTERM)
        elif deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(POLL_S)
    result.returncodes = codes
    if result.failed_rank is None and not ended_by_rank0 and any(_abnormal(c) for c in codes):
        # every worker ended between two polls (a loaded machine): the same rule decides
        result.failed_rank = _first_failed(codes)
    if result.failed_rank is not None:
        result.code = EXIT_BAD_INPUT
    else:
        result.code = max(codes)  # agreed stops: every rank exits 1 (halt) or 2 (NaN)
    return result
