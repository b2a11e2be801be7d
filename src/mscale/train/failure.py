"""What a failed training process leaves behind, so `recover` can tell what happened.

Every rank that fails writes ``logs/rank<N>.error.json`` (in the spirit of torchelastic's
``@record`` error files): the kind of failure, the exception, its traceback, the node and the
time. The kinds are the decisions recover makes from them:

- ``bad_input``: an `MscaleError` (a plan, a checkpoint, a data file): fix the input, do not retry;
- ``disk_full``: the run directory's filesystem is full: free space, then resume;
- ``timeout``: a collective did not complete within ``--timeout`` — this rank waited for a peer
  that is hung, stopped or dead; the peer that did *not* time out is the suspect;
- ``network``: the job could not rendezvous or lost a connection (a peer died): gloo's
  ``Connection closed by peer``, a reset, a broken pipe *between ranks*;
- ``console``: the process's own stdout/stderr was closed under it (a ``BrokenPipeError`` from
  Python's I/O: the terminal or the process reading it went away). Not the node, not the
  network. Workers write their console best-effort (distributed/stdio.py), so this is only left
  by a write that bypassed it;
- ``launcher_died``: the ``--local`` launcher is gone (killed, crashed) and this worker stopped
  itself, as every worker does (distributed/lifeline.py): nobody supervised the job any more.
  Not a fault of the node, the network or the job: relaunch from the latest checkpoint;
- ``crash``: anything else (a bug, an OOM): the traceback says which.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
import traceback

from mscale.config.records import Event
from mscale.distributed import flight
from mscale.distributed.lifeline import say_in_log
from mscale.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, MscaleError, carries_interrupt
from mscale.runs.atomic import DiskFullError, fs_and_path, write_text_atomic
from mscale.runs.lock import run_id_from_env
from mscale.runs.rundir import RunDir

_TIMEOUT = re.compile(r"timed? ?out|timeout|deadline exceeded", re.IGNORECASE)
_NETWORK = re.compile(r"connection (reset|closed|refused)|broken pipe|socket|rendezvous|"
                      r"DistNetworkError|connect", re.IGNORECASE)


def classify(exc: BaseException) -> str:
    """The failure kind of an exception (module docstring)."""
    if console_closed(exc):
        return "console"
    if isinstance(exc, DiskFullError):
        return "disk_full"
    if isinstance(exc, MscaleError):
        return "bad_input"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk_full"
    text = f"{type(exc).__name__}: {exc}"
    if _TIMEOUT.search(text):
        return "timeout"
    if _NETWORK.search(text):
        return "network"
    return "crash"


def console_closed(exc: BaseException) -> bool:
    """A ``BrokenPipeError`` raised by Python's own I/O: in a training process that is a write to
    its stdout or stderr whose reader went away. Connections between ranks live in gloo/NCCL,
    whose failures are ``RuntimeError``s carrying the text (``Connection closed by peer``,
    ``Broken pipe``): those stay ``network``."""
    return type(exc) is BrokenPipeError and exc.filename is None


def one_line(exc: BaseException) -> str:
    """The exception as one line (the first line of its message), for the console."""
    if isinstance(exc, MscaleError):
        return str(exc).replace("\n  fix:", "; fix:")
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


FLIGHT_KINDS = ("network", "timeout", "crash")
"""Kinds after which this rank's flight record is dumped (`distributed/flight.py`): where it
was in its collectives tells recover which rank the job waited for."""
AFTERMATH = ("network", "timeout")
"""Kinds that are mostly another rank's failure seen from here (a peer died, a peer hung).
Under ``--local`` such a line goes to the rank's log only: rank 0's would otherwise reach the
console before the launcher's line, which names the rank that failed first (and this one's
kind and message, if it was the first)."""

_SOURCE_PREFIX = re.compile(r"^(\w+: )\[[^\]\s]+:\d+\] ")
"""gloo's ``[/__w/pytorch/.../pair.cc:553] `` before its message: noise on a console."""


def _console_text(exc: BaseException) -> str:
    """`one_line` without a C++ source location (the error file keeps the message whole)."""
    return _SOURCE_PREFIX.sub(r"\1", one_line(exc))


def error_file(run: RunDir, rank: int) -> str:
    return run.path("logs", f"rank{rank}.error.json")


def write_error_file(run: RunDir, rank: int, node: str, exc: BaseException) -> str | None:
    """Write this rank's error file; returns its path, or None when it could not be written (a
    full disk): the console line still says what happened."""
    record = {"rank": rank, "node": node, "time": time.time(), "kind": classify(exc),
              "exception": type(exc).__name__, "message": one_line(exc),
              "traceback": "".join(traceback.format_exception(exc))}
    if os.environ.get("MSCALE_RUN_ID"):  # a --local launch: its launcher reads only its own
        record["run_id"] = os.environ["MSCALE_RUN_ID"]
    if isinstance(exc, MscaleError):  # where the bad input is: recover reads the file named
        record.update(file=exc.file, field=exc.field)  # (a damaged checkpoint: a rollback)
    path = error_file(run, rank)
    try:
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    except Exception:  # noqa: BLE001 - reporting must not replace the original failure
        return None
    return path


def read_error_files(run: RunDir, since: float | None = None,
                     run_id: str | None = None) -> dict[int, dict]:
    """Every rank's error file that parses, by rank (what the launcher and recover read); with
    ``run_id``, only that launch's (files that name no launch: those written at or after
    ``since``, a wall-clock time, less `CLOCK_SLACK_S`). An attempt leaves its error files
    behind: the next attempt's launcher quoted one as the cause of its own failure."""
    out: dict[int, dict] = {}
    try:
        fs, root = fs_and_path(run.logs)
        names = fs.ls(root, detail=False) if fs.exists(root) else []
    except (OSError, MscaleError):
        return out
    for path in names:
        m = re.search(r"rank(\d+)\.error\.json$", path)
        if not m:
            continue
        try:
            rec = json.loads(fs.cat_file(path))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and _of_this_launch(rec, since, run_id):
            out[int(m.group(1))] = rec
    return out


CLOCK_SLACK_S = 2.0
"""How far a clock may step back (NTP) between a launch and a worker's error file."""


def _of_this_launch(rec: dict, since: float | None, run_id: str | None) -> bool:
    if run_id is not None and "run_id" in rec:
        return rec["run_id"] == run_id
    if since is None:
        return True
    when = rec.get("time")
    return (isinstance(when, (int, float)) and not isinstance(when, bool)
            and when >= since - CLOCK_SLACK_S)


def launcher_gone_message(why: str) -> str:
    """What a worker whose ``--local`` launcher is gone says (its log line, error file, event)."""
    return (f"the --local launcher {why}; this worker stopped itself, as every worker does "
            "when its launcher is gone: no fault of this node or of the job, the same command "
            "(or mscale recover) resumes from the latest checkpoint")


def launcher_gone_line(run: RunDir, rank: int, node: str, why: str) -> str:
    """The one line in the rank's log (the error file's path in it)."""
    return (f"error (rank {rank} on {node}, launcher_died): {launcher_gone_message(why)}; "
            f"details in {error_file(run, rank)}")


def record_launcher_gone(run: RunDir, rank: int, node: str, why: str) -> str | None:
    """This rank's error file of kind ``launcher_died`` and, on rank 0, a ``stop`` event: the
    launcher that would have written the job's end is gone. Returns the error file's path, or
    None when it could not be written. No traceback: nothing in this process failed."""
    message = launcher_gone_message(why)
    record = {"rank": rank, "node": node, "time": time.time(), "kind": "launcher_died",
              "exception": None, "message": message, "traceback": ""}
    path: str | None = error_file(run, rank)
    try:
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    except Exception:  # noqa: BLE001 - the log line already says it
        path = None
    if rank == 0:
        evidence = {"kind": "launcher_died", "reason": "launcher_died", "code": EXIT_BAD_INPUT,
                    "run_id": run_id_from_env(), "error_file": f"logs/rank{rank}.error.json"}
        run.append_record(run.events, Event(
            source="train", kind="stop", severity="critical", message=f"stopped: {message}",
            evidence=evidence))
    return path


class ReportedFailure(Exception):
    """A failure this rank has already reported (`report_failure`: its line, its error file):
    the process's edge only exits with ``code``. Rank 0's failed start is reported before its
    peers are told (`session.agree_on_rank0`), so that a peer exiting first cannot get rank 0
    stopped by the launcher before it has said why."""

    def __init__(self, code: int):
        super().__init__(f"already reported (exit {code})")
        self.code = code


def report_failure(run: RunDir, rank: int, node: str, exc: BaseException) -> int:
    """One line on stderr, the error file, and the exit code for ``exc``."""
    if carries_interrupt(exc):  # a second Ctrl-C (train/control.py), or one in disguise
        if os.environ.get("MSCALE_LAUNCHER") == "local":  # its launcher says it, once, and
            say_in_log(f"rank {rank}: interrupted\n")  # records it: this rank's log only
            return EXIT_INTERRUPTED
        sys.stderr.write(f"rank {rank}: interrupted\n")
        if rank == 0:
            _interrupted_event(run)
        return EXIT_INTERRUPTED
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    kind = classify(exc)
    path = write_error_file(run, rank, node, exc) if rank >= 0 else None
    if kind in FLIGHT_KINDS and rank >= 0:
        flight.write_dump(run.logs, rank)
    where = f"; details in {path}" if path else ""
    line = f"error (rank {rank} on {node}, {kind}): {_console_text(exc)}{where}"
    if os.environ.get("MSCALE_DEBUG"):  # `mscale --debug train ...`
        traceback.print_exception(exc, file=sys.stderr)
    if kind in AFTERMATH and os.environ.get("MSCALE_LAUNCHER") == "local":
        say_in_log(line + "\n")  # the launcher's line names the first failure; this follows it
    else:
        sys.stderr.write(line + "\n")
    if rank == 0 and os.environ.get("MSCALE_LAUNCHER") != "local":  # --local's launcher does it
        _stop_event(run, rank, node, kind, line, _console_text(exc))
    # 3 for every failure: a damaged checkpoint's MscaleError carries verify's 2, which for
    # train would read as "NaN stop"
    return EXIT_BAD_INPUT


def _interrupted_event(run: RunDir) -> None:
    """Under srun/torchrun: rank 0's record of an operator's interruption (the same ``stop``
    event as the --local launcher's, train/job_watch.py), so watch and recover read a stop,
    not a crash."""
    _own_stop(run, 0, kind="stop", severity="warning",
              message="interrupted: a second SIGINT stopped rank 0 at once, without a checkpoint",
              evidence={"reason": "interrupted", "signal": "SIGINT", "code": EXIT_INTERRUPTED})


def _stop_event(run: RunDir, rank: int, node: str, kind: str, line: str, text: str) -> None:
    """Under srun/torchrun nobody else sees the job end: rank 0 records its own view.

    A network error or a timeout (`AFTERMATH`) is mostly a peer's failure seen from rank 0: a
    task killed on node3 reaches rank 0 as ``Connection closed by peer``. Such an event names no
    rank or node, so that watch's stop line does not put rank 0's node in the place of the
    failed one; recover finds that one from every rank's error file and SLURM's log."""
    if kind in AFTERMATH:
        waited = "timed out waiting for a peer" if kind == "timeout" else "lost a peer"
        fields = {"ranks": [], "nodes": [],
                  "message": f"rank {rank} on {node} {waited} ({kind}): {text}; `mscale "
                             "recover RUN` names the rank that failed"}
    else:
        fields = {"ranks": [rank], "nodes": [node], "message": line}
    _own_stop(run, rank, kind="hang" if kind == "timeout" else "stop", severity="critical",
              evidence={"kind": kind, "error_file": f"logs/rank{rank}.error.json",
                        "observer": {"rank": rank, "node": node}}, **fields)


def _own_stop(run: RunDir, rank: int, **fields) -> None:
    """Append rank 0's own ``stop``/``hang`` event, with the launch's run id when there is one
    (recover scopes evidence to one attempt by run id, also one that failed before `start`)."""
    if any(os.environ.get(k) for k in ("MSCALE_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")):
        fields["evidence"]["run_id"] = run_id_from_env()
    try:
        run.append_record(run.events, Event(source="train", **fields))
    except Exception:  # noqa: BLE001 - the console line above already says what happened
        sys.stderr.write(f"rank {rank}: the stop event could not be written to {run.events}\n")
