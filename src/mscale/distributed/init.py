"""Start and stop torch.distributed for one process of a job.

nccl when CUDA is present, gloo otherwise; every collective gets an explicit timeout (gloo's
default is 30 minutes, so a hung test would hang CI for 30 minutes: docs/references.md).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mscale.distributed import flight
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.topology.env import LaunchEnv

DEFAULT_TIMEOUT_S = float(os.environ.get("MSCALE_DIST_TIMEOUT", 120))


def pick_backend() -> str:
    """gloo on CPUs; on GPUs NCCL for CUDA tensors *and* gloo for CPU tensors.

    The loop's small bookkeeping collectives (control flags, the per-rank timing vectors, the
    token batch broadcast to TP peers) carry CPU tensors, which NCCL cannot move; a mixed default
    group routes each tensor to the backend of its device, and every sub-group inherits it.
    """
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def pick_device(env: LaunchEnv) -> torch.device:
    """The device this process computes on: its local GPU, or the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto ``device``. To a GPU from pinned memory, asynchronously: a plain
    ``.to("cuda")`` of pageable memory waits until the stream has caught up with the host,
    once per micro-batch (the pinned copy stays alive until the copy is done: torch's pinned
    allocator reuses it only then)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def init_distributed(env: LaunchEnv, timeout_s: float = DEFAULT_TIMEOUT_S,
                     backend: str | None = None) -> timedelta:
    """Join the job's default process group; returns the timeout used for every group."""
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        check_rendezvous_host(env.master_addr)
        flight.enable()  # before the first group: torch sizes the recorder then
        dist.init_process_group(
            backend=backend or pick_backend(), init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank, world_size=env.world_size, timeout=timeout)
    return timeout


def check_rendezvous_host(addr: str) -> None:
    """Refuse a rendezvous host this machine cannot resolve, at once and in one line. torch
    would retry the connection for the whole timeout, every rank printing a warning a second
    (a user trial under srun: 3.5 minutes, ~90 warnings, then a C++ error naming no variable);
    under srun the host is the job's first node name unless ``MASTER_ADDR`` says otherwise, and
    that name need not resolve on every network (topology/env.py, docs/slurm.md)."""
    for attempt in range(RESOLVE_TRIES):
        try:
            socket.getaddrinfo(addr, None)
            return
        except socket.gaierror as e:
            if e.errno == socket.EAI_AGAIN and attempt + 1 < RESOLVE_TRIES:
                time.sleep(1.0)  # the resolver is busy (thousands of ranks at once): again
                continue
            why = e.strerror or str(e)
        except UnicodeError as e:  # not a host name at all (a label over 63 characters, "a..b")
            why = str(e) or "not a valid host name"
        raise MscaleError(f"the rendezvous host {addr!r} does not resolve on "
                          f"{socket.gethostname()} ({why})", field="MASTER_ADDR",
                          fix="set MASTER_ADDR, inside the step, to an address of rank 0's "
                              "node that every node can reach (docs/slurm.md, the "
                              "'Rendezvous:' item)")


RESOLVE_TRIES = 5
"""Tries of a name the resolver answers "try again" for, a second apart."""


def shutdown_and_exit(code: int = 0, barrier: bool = True) -> None:
    """Leave the job cleanly and end the process with ``code``.

    Processes that used gloo sometimes die at interpreter exit with SIGABRT ("terminate called
    without an active exception", pytorch issue 190489), which makes a launcher report a failure
    after a run that succeeded. Measured here (docs/references.md): barrier → destroy_process_group → flush →
    ``os._exit`` gave 0 failures in 20 runs, so every clean exit goes through this function.
    A final barrier that fails (a peer died after its last step) is said on stderr and turns a
    code of 0 into 3: the job did not end cleanly, and a launcher must not be told it did.
    """
    try:
        if dist.is_initialized():
            if barrier:
                try:
                    dist.barrier()
                except Exception as e:  # noqa: BLE001 - said on stderr and in the exit code
                    first = (str(e).strip().splitlines() or [""])[0][:200]
                    sys.stderr.write(f"error: the final barrier failed ({type(e).__name__}: "
                                     f"{first}): a peer did not finish cleanly\n")
                    code = code if code else EXIT_BAD_INPUT
            dist.destroy_process_group()
    finally:
        _release_ipc_objects()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _release_ipc_objects() -> None:
    """Run multiprocessing's exit finalizers, as a normal interpreter exit would.

    ``os._exit`` skips them, and then multiprocessing's resource tracker reports every named
    semaphore not unlinked as leaked, on the console, after the job's closing line. A compiled
    model creates one: torch.fx's interpreter opens a (disabled) tqdm bar, and tqdm makes a
    process-shared lock whenever the start method is not fork (ours is forkserver). Finalizers
    of priority >= 0 are the ones that unlink such objects (``multiprocessing.util``)."""
    from multiprocessing import util

    try:
        util._run_finalizers(0)
    except Exception as e:  # noqa: BLE001 - the run is over; say it, keep the exit code
        sys.stderr.write(f"warning: multiprocessing clean-up at exit failed: {e}\n")
