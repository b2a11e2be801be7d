"""``mscale train PLAN --local N``: start N worker processes on this machine and watch them.

Each worker is the same ``mscale train`` command with torchrun-style variables (RANK, WORLD_SIZE,
LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT), so the worker path is the one torchrun and srun use.
Ranks are grouped into "nodes" of the plan's gpus_per_node, so node checks and hierarchical groups
behave as on a cluster. If any worker fails, the others are stopped (SIGTERM, then SIGKILL after a
grace period) and the first failure's exit code is returned: a dead rank must never leave its peers
hanging. SIGINT/SIGTERM to the launcher are forwarded as SIGTERM, which workers treat as "halt at
the next step boundary".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(nprocs: int, gpus_per_node: int, worker_args: list[str], log_dir: str,
                 quiet_rank0: bool = False) -> int:
    """Run ``mscale <worker_args>`` on ``nprocs`` local processes; return the job's exit code."""
    os.makedirs(log_dir, exist_ok=True)
    port = _free_port()
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    procs: list[subprocess.Popen] = []
    logs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_RANK=str(rank % gpus_per_node),
                   LOCAL_WORLD_SIZE=str(min(gpus_per_node, nprocs)),
                   GROUP_RANK=str(rank // gpus_per_node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), MSCALE_LAUNCHER="local",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        logs.append(log)
        to_terminal = rank == 0 and not quiet_rank0
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mscale.cli.main", *worker_args], env=env,
            stdout=None if to_terminal else log, stderr=None if to_terminal else subprocess.STDOUT))

    def forward(signum, frame):  # noqa: ARG001
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for log in logs:
            log.close()


def _watch(procs: list[subprocess.Popen]) -> int:
    first_failure: int | None = None
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if first_failure is None:
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                first_failure = failed[0]
                deadline = time.monotonic() + GRACE_S
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
        elif deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    if first_failure is None:
        nonzero = [c for c in codes if c]
        first_failure = nonzero[0] if nonzero else 0
    # a worker killed by signal N reports -N; shells report 128+N
    return first_failure if first_failure >= 0 else 128 - first_failure
