"""Start a ``--local`` job's workers by forking them from one process that imported torch once.

Every worker of a local job used to be a fresh ``python -c ENTRY``, and each spent ~2.5 s of CPU
importing torch and mscale before its first line of work: on a two-core machine a 4-process start
took ~4 s and an 8-process one ~7.5 s, most of it the same imports N times over. Here
multiprocessing's ``forkserver`` imports them once (``preload``) in a server process, and each
worker is a fork of it, sharing those pages. The launcher itself still imports no torch: the
server is a separate process (docs/architecture.md, "Launchers import no torch").

A forked worker sees what a spawned one did: its own environment (RANK, MASTER_PORT, ...), its
arguments in ``sys.argv``, stdout and stderr on its log (rank 0's on a pipe the launcher tees),
stdin on /dev/null, the ``__main__`` namespace of ``python -c``. Its exit code is the one it
exits with, or minus the signal that killed it, as `subprocess.Popen` reports; `Worker` has the
part of Popen's interface the launcher's watch uses. The server is started on first use and
lives as long as the launcher (one per process).

On a machine with NVIDIA devices the workers are spawned as before (`FORK_WORKERS`): CUDA cannot
be used in a fork whose parent initialised it, and whether an import touches the driver is not
something to promise for every torch version. ``MSCALE_SPAWN_WORKERS=1`` spawns them anywhere.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker
from multiprocessing.reduction import DupFd
from typing import Sequence


FORK_WORKERS = (os.environ.get("MSCALE_SPAWN_WORKERS", "") in ("", "0")
                and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia")))
"""Fork workers from the server (no NVIDIA device here, spawning not asked for)."""


class _Fd:
    """An open file descriptor handed to a forked worker: duplicated into the server (and so
    into the worker) when the process start pickles it; the worker gets the descriptor."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (DupFd(self.fd),)


_SHIELD = {signal.SIGTERM, signal.SIGINT}
"""Blocked while the server starts (`start`), so the server inherits the mask; each worker
unblocks them (`_run`)."""


def _detach(dup) -> int:
    return dup.detach()


def _run(entry: str, argv: list[str], env: dict[str, str], out: int) -> None:
    """The worker's body, in the forked process: ``python -c ENTRY ARGV`` as far as the entry
    can tell. A ``SystemExit`` becomes the process's exit code (multiprocessing's bootstrap)."""
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        # the OpenMP runtime read the variable when the server loaded it, not here
        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["-c", *argv]
    try:
        # the server's shield (`start`): a Ctrl-C pending since the fork is raised here, inside
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SHIELD)
        exec(compile(entry, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - ours
    except KeyboardInterrupt:  # a Ctrl-C before the entry's own handling: 130, as a shell says
        raise SystemExit(130) from None  # (multiprocessing's bootstrap would exit 1: "halted")


class Worker:
    """One forked worker, with `subprocess.Popen`'s ``pid``, ``poll``, ``send_signal``, ``kill``."""

    def __init__(self, process: multiprocessing.Process):
        self.process = process
        self.pid: int = process.pid

    def poll(self) -> int | None:
        """The exit code (minus the signal that killed it), or None while it runs."""
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended between the poll and the kill
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def guarded(entry: str) -> str:
    """``entry`` with an exception it leaves unhandled made exit 3, a crash, with its traceback
    in the worker's log. Python ends on one with 1, which a launcher reads as "halted on request"
    (the exit-code contract): workers whose import failed ended 1 and were not counted failed,
    and the launcher blamed a rank it had stopped itself. The entry is compiled as it is (not
    re-indented: its string literals and ``from __future__`` lines stay valid) and run in the
    module's globals, as ``python -c`` would."""
    return ("import sys as _sys, traceback as _traceback\n"
            "try:\n"
            f"    exec(compile({entry!r}, '<string>', 'exec'), globals())\n"
            "except Exception:\n"
            "    _traceback.print_exc()\n"
            "    _sys.exit(3)\n")


def start(entry: str, argv: Sequence[str], env: dict[str, str], out_fd: int,
          preload: Sequence[str]) -> Worker | subprocess.Popen:
    """Start a worker that runs ``entry`` (``python -c`` code) with ``argv``, the environment
    ``env`` and its output on ``out_fd`` (which the caller may close once this returns): forked
    from the server, which imports ``preload`` before its first fork (set by the first call),
    or spawned where `FORK_WORKERS` is false."""
    entry = guarded(entry)
    if not FORK_WORKERS:
        return subprocess.Popen([sys.executable, "-c", entry, *argv], env=env, stdout=out_fd,
                                stderr=subprocess.STDOUT)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, *preload])
    process = ctx.Process(target=_run, args=(entry, list(argv), dict(env), _Fd(out_fd)),
                          daemon=False)
    # The server, started by the first call, forks from this thread and keeps its signal mask:
    # with SIGTERM blocked it outlives a SIGTERM to the whole process group (`timeout`,
    # `kill -TERM -- -PGID`), which the workers handle and the launcher forwards. Had it died,
    # every worker's exit code, read through it, would be 255: a clean halt read as a failure.
    # SIGINT is blocked too: the server ignores it once serving, but a Ctrl-C while it still
    # imports ``preload`` (a second or more) would end it in a KeyboardInterrupt traceback on
    # the console and fail the start. Blocked, it waits, and the server's SIG_IGN discards it.
    # Each worker unblocks both in `_run`. A signal to this thread meanwhile stays pending, then
    # is handled. The resource tracker is started first: starting it unblocks SIGINT and SIGTERM
    # in this thread (multiprocessing.resource_tracker), which would undo the shield before the
    # server is started.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELD)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return Worker(process)
