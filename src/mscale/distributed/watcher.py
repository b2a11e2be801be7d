"""Watch a local job's worker processes to the end, and say how it ended (`JobResult`).

The watcher polls every `POLL_S`. The first worker to end abnormally (exit code 3, any other
code outside 0-2, or a signal) is the job's failure; the others get SIGTERM and `GRACE_S` to
record what they saw, then SIGKILL. At that moment it also notes which workers were still running
and which were *stopped* (state ``T``: SIGSTOP, a debugger): when the failure is a collective
timeout, those are the hung ranks the others waited for, the ones that never time out
themselves. Agreed stops (every rank exits 1 on a halt, 2 on a NaN) are not failures.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from mscale.errors import EXIT_BAD_INPUT

if TYPE_CHECKING:
    import subprocess

    from mscale.distributed import forkserver

GRACE_S = 15.0
"""Seconds the other workers have, after a failure or rank 0's end, before SIGKILL."""
POLL_S = 0.1
"""Seconds between two polls of the workers."""


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
    failed_at: float | None = None
    """When the watch saw the first abnormal end (``time.monotonic``)."""
    stop_signal: str | None = None
    """The first stop signal the launcher received (``SIGINT``), when it came before any
    worker ended abnormally: the operator asked the job to stop. Whether an abnormal end after
    it was the stop's doing is the caller's judgement (its codes, its error files)."""
    forced: bool = False
    """A second Ctrl-C killed the workers, without a checkpoint."""
    abandoned: str | None = None
    """Why the launcher killed the workers itself (`LocalJob.abandon`), None if it did not."""
    rank0_last_line: str = ""
    """The last line rank 0 printed (``--local``): its own word on how it ended, which a full
    disk may have kept out of ``events.jsonl``."""


def abnormal(code: int | None) -> bool:
    return code is not None and code not in (0, 1, 2)


def describe_exit(code: int | None) -> str:
    """A worker's end in words: ``killed by SIGKILL``, ``exited with code 3``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def first_failed(codes: list[int | None]) -> int:
    """The rank that failed first among those that ended abnormally. A signal beats an exit
    code: the peers of a killed rank exit 3 right after it, having lost their connection."""
    bad = [r for r, c in enumerate(codes) if abnormal(c)]
    return min(bad, key=lambda r: (codes[r] >= 0, r))


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def watch_workers(procs: list[forkserver.Worker | subprocess.Popen], rank0_ends_job: bool = False,
           on_poll: Callable[[list[int | None]], None] | None = None) -> JobResult:
    result = JobResult(code=0, returncodes=[])
    ended_by_rank0 = False
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if on_poll is not None:
            try:
                on_poll(codes)
            except Exception:  # noqa: BLE001 - showing progress must never stop the watching
                pass
        if deadline is None and rank0_ends_job and codes[0] == 0:
            ended_by_rank0, deadline = True, time.monotonic() + GRACE_S
            for p in procs[1:]:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        elif deadline is None and any(c not in (None, 0) for c in codes):
            bad = [r for r, c in enumerate(codes) if abnormal(c)]
            if bad:
                result.failed_rank, result.failed_at = first_failed(codes), time.monotonic()
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
    if result.failed_rank is None and not ended_by_rank0 and any(abnormal(c) for c in codes):
        # every worker ended between two polls (a loaded machine): the same rule decides
        result.failed_rank, result.failed_at = first_failed(codes), time.monotonic()
    if result.failed_rank is not None:
        result.code = EXIT_BAD_INPUT
    else:
        result.code = max(codes)  # agreed stops: every rank exits 1 (halt) or 2 (NaN)
    return result
