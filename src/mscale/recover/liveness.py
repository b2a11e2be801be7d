"""recover acts on a stopped run: a run directory whose lock a live job holds is refused.

Why: a running job's directory is mid-write. Its newest checkpoint may be uncommitted only
because the job is writing it, its events have no ``stop`` yet, its metrics grow every step. A
diagnosis of it describes a failure that has not happened (the same run read as UNRECOVERABLE
at one moment and RELAUNCHABLE the next), a decision written for it would be acted on by no one
(or by a later recover, wrongly), and a relaunch only meets the lock (train refuses, exit 3).
So `plan_recovery` and `apply_plan` refuse with one line (`RunInUse`, exit 3) and write nothing,
dry run or not; ``mscale watch RUN`` is the tool for a live run.

"Live" is `mscale.runs.lock`'s own rule (`live_holder`: the holder's pid exists on this host,
or, from another host, its heartbeat is younger than its lease), never a second one. A job that
just died on another host looks live until its lease passes: `wait_until_free` waits that out
(supervise after its own job exits; ``mscale recover --wait S``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.lock import LockRecord, holder_text, live_holder
from mscale.runs.rundir import RunDir

LOCAL_GRACE_S = 10.0
"""How long a lock held on this host may take to be let go after its job's launcher exited (a
killed holder not yet reaped by its parent still has a pid)."""


class RunInUse(MscaleError):
    """The run directory is held by a live job (exit 3; the message is the whole line)."""


def in_use_line(run_dir: str, rec: LockRecord, now: float | None = None) -> str:
    """The one line of a refusal: who holds the run, and the two ways forward."""
    halt = RunDir(run_dir).path("control", "halt")
    return (f"{run_dir} is in use by a running job ({holder_text(rec, now)}): recover acts on a "
            f"stopped run; stop it (touch {halt}) or wait for it to end (mscale watch "
            f"{run_dir} follows a live run)")


def refuse_if_live(run_dir: str) -> None:
    """Raise `RunInUse` when a live job holds ``run_dir``'s lock (module docstring)."""
    rec = live_holder(run_dir)
    if rec is not None:
        raise RunInUse(in_use_line(run_dir, rec), code=EXIT_BAD_INPUT)


def wait_until_free(run_dir: str, wait_s: float, *, clock: Callable[[], float] = time.time,
                    sleep: Callable[[float], None] = time.sleep,
                    poll_s: float = 0.5) -> LockRecord | None:
    """Poll until no live job holds ``run_dir`` (then None) or ``wait_s`` passed (then the live
    holder's record). ``wait_s`` < 0: as long as the holder's lease can keep it live — its
    remaining lease when it is on another host, `LOCAL_GRACE_S` on this one (its pid answers
    at once, once it is reaped)."""
    rec = live_holder(run_dir, clock())
    if rec is None:
        return None
    if wait_s < 0:
        here = rec.host == socket.gethostname()
        wait_s = LOCAL_GRACE_S if here else max(0.0, rec.heartbeat + rec.lease_s - clock()) + 1
    deadline = clock() + wait_s
    while rec is not None and clock() < deadline:
        sleep(min(poll_s, max(0.0, deadline - clock())))
        rec = live_holder(run_dir, clock())
    return rec
