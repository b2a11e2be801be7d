"""Run a function on N local gloo processes and collect what each returns.

The distributed tests and the benchmarks in bench/ go through `run_distributed`: it picks a free port, gives each process
an explicit collective timeout, turns a child's exception into a test failure with its traceback,
kills everything if one process hangs, and exits children with os._exit so gloo's exit-time abort
(docs/references.md) never turns a pass into a failure.

Children are forked from a fork server that imported torch once (multiprocessing's
``forkserver``, started on the first call and kept for the calling process's life): a spawned
child imported torch again, ~2.5 s of CPU each on these cores. Still, each launch pays the
process group's set-up, so tests should run several cases per launch instead of one per case. It lives in the package (not under tests/) so
that benchmarks run from any directory without the test suite on the import path.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from mscale.distributed.ports import free_port  # the launcher's; tests and bench import it here


PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "mscale.distributed.spawn"]
"""What the fork server imports before it forks any child."""


class DistributedRunError(AssertionError):
    """A child raised, hung or died; the message holds every child's traceback. An
    AssertionError so that pytest shows it as a test failure with its message."""


def _child(rank: int, world: int, port: int, outdir: str, timeout_s: float,
           fn: Callable[..., Any], args: tuple, environ: dict[str, str], cwd: str) -> None:
    import torch.distributed as dist

    # the caller's environment and directory now, not the fork server's from when it started
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        torch.save({"result": result}, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_distributed(fn: Callable[..., Any], world: int, *args: Any,
                    timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; return their results by rank.

    ``fn`` must be a module-level function (it is pickled into spawned processes) and return
    tensors / plain Python data. Collectives time out after ``timeout_s``; the whole run after
    ``2 * timeout_s + 30`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read once, when the server starts
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mscale-dist-") as outdir:
        procs = [ctx.Process(target=_child, args=(r, world, port, outdir, timeout_s, fn, args,
                                                  dict(os.environ), os.getcwd()))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = 2 * timeout_s + 30
        import time

        t0 = time.monotonic()
        for p in procs:
            p.join(max(1.0, deadline - (time.monotonic() - t0)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        errors = []
        for r in range(world):
            err = os.path.join(outdir, f"rank{r}.err")
            if os.path.exists(err):
                with open(err) as f:
                    errors.append(f"--- rank {r} ---\n{f.read()}")
        if errors:
            raise DistributedRunError("distributed run failed:\n" + "\n".join(errors))
        if hung:
            raise DistributedRunError(f"ranks {hung} did not finish within {deadline:.0f} s")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise DistributedRunError(f"ranks {bad} exited with {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=True)["result"]
                for r in range(world)]
