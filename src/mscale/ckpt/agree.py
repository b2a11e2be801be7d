"""How every rank of a resume agrees on one outcome: a step that fails on any rank fails on all
of them alike, before any rank enters a collective the failed one would never join.

Used by `Checkpointer.resume` (checkpointer.py) for choosing the checkpoint (rank 0 parses its
manifest, every rank gets the choice) and for reading it (every rank reads its part). All the
collectives are small ones on the checkpointer's own gloo group, so each has the job's
--timeout.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Callable

from mscale.ckpt import commit
from mscale.ckpt.resume import ResumePoint
from mscale.errors import EXIT_BAD_INPUT, MscaleError

WAIT_POLL_S = 0.2
"""Seconds between two polls of the ranks waiting for rank 0, or for a save to be written."""


def agree(fn: Callable[[], object], group, rank: int, share: bool = True):
    """Run ``fn`` (rank 0 only when ``share``, then broadcast its `ResumePoint` or None); if it
    raises on any rank, raise the same MscaleError on every rank (exit 3: this run cannot start
    from that checkpoint)."""
    result, error = None, None
    run = fn
    if share:
        done = rank0_runs(fn, group, rank)
        run = None if done is None else done.result
    if run is not None:
        try:
            result = run()
        except MscaleError as e:
            error = {"message": e.message, "file": e.file, "field": e.field, "fix": e.fix}
        except Exception as e:  # noqa: BLE001 - reported on every rank, with the rank
            error = {"message": f"rank {rank}: {type(e).__name__}: {e}"}
    errors = commit.gather_json(error, group)
    first = commit.broadcast_json(next((e for e in errors if e), None) if errors else None, group)
    if first:
        raise MscaleError(first["message"], file=first.get("file"), field=first.get("field"),
                          fix=first.get("fix"), code=EXIT_BAD_INPUT)
    if share:
        shared = commit.broadcast_json(result.to_json() if result else None, group)
        return ResumePoint.from_json(shared) if shared else None
    return result


def rank0_runs(fn: Callable[[], object], group, rank: int) -> futures.Future | None:
    """Collective: rank 0 runs ``fn`` on a thread while every rank asks every `WAIT_POLL_S`
    whether it is done (as `Checkpointer.wait` does for a write), so no rank sits in one
    collective for all of it: choosing the checkpoint parses its manifest, which took ~2 minutes
    at 175B on 12,288 ranks in schema 1 (0.75 s in schema 2, docs/benchmarks.md), past a 120 s
    --timeout; a slow filesystem can still. Rank 0 gets the future, the others None."""
    pool = futures.ThreadPoolExecutor(1, "mscale-resume") if rank == 0 else None
    done = pool.submit(fn) if pool is not None else None
    try:
        while commit.status(done is not None and not done.done(), False, group)[0]:
            if done is not None:
                futures.wait([done], timeout=WAIT_POLL_S)
            else:
                time.sleep(WAIT_POLL_S)
    finally:
        if pool is not None:
            pool.shutdown(wait=False)
    return done
