"""A run directory whose job ended, written as train's own writers write it, for the tests of
how watch judges the end (test_ending*.py, test_liveness.py).

The stop and hang events are written by train's own writers wherever they can be called without a
job (the ``--local`` launcher's `record_failure`, a failed rank's `report_failure` under srun);
rank 0's own stop at a finish or an agreed stop is written in the shape `train/loop.py: _finish`
gives it. The ``rd`` fixture (conftest.py) is such a run of the cpu-tiny plan.
"""

from __future__ import annotations

import json
import os
import socket
import time

from mscale.config.records import Event
from mscale.distributed.watcher import JobResult
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan
from mscale.train.failure import read_error_files
from mscale.train.job_watch import record_failure
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.follow import EventFeed, Follower
from mscale.watch.sim import simulate
from mscale.watch.stream import MetricsFeed, records_to_window
from mscale.watch.target import layout_source, resolve_target

from tests.conftest import PLANS


KILLED = "CRITICAL job stopped: rank 5 on node3 killed by SIGKILL (exit 3)"


WORLD = 8


def records(first: int, last: int, seed: int = 1) -> list[dict]:
    """Healthy records of the cpu-tiny layout (tp 2 × pp 2 × dp 2, two ranks a node)."""
    recs = simulate(WORLD, tp=2, pp=2, ranks_per_node=2, steps=last, seed=seed)
    return [r for r in recs if r["step"] >= first]


def append_metrics(rd: RunDir, recs: list[dict]) -> None:
    with open(rd.metrics, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def event(rd: RunDir, **fields) -> None:
    rd.append_record(rd.events, Event(source="train", **fields))


def start(rd: RunDir, attempt: int) -> None:
    event(rd, kind="start", message=f"training cpu-tiny on {WORLD} processes (local)",
          evidence={"run_id": f"local-{attempt}", "attempt": attempt, "launcher": "local"})


def running(rd: RunDir, attempt: int = 1) -> None:
    """The attempt's job holds the run's lock (this process: alive, on this host): without a
    lock, a start with no stop after it is a job gone without recording its end."""
    now = time.time()
    with open(rd.lock, "w") as f:
        json.dump({"run_id": f"local-{attempt}", "host": socket.gethostname(),
                   "pid": os.getpid(), "since": now, "heartbeat": now, "lease_s": 120.0,
                   "token": "t"}, f)


def own_stop(rd: RunDir, code: int, step: int, reason: str | None = None,
             detail: str | None = None, attempt: int = 1, signal: str | None = None) -> None:
    """Rank 0's stop at the end of the loop (train/loop.py: _finish)."""
    figures = {"code": code, "last_checkpoint": None, "run_id": f"local-{attempt}",
               "attempt": attempt}
    if reason:
        figures["reason"] = reason
        if detail:
            figures["detail"] = detail
    if signal:
        figures["signal"] = signal
    event(rd, kind="stop", severity="info" if code == 0 else "warning", step=step,
          message=f"training process exited with code {code}" + (f" ({reason})" if reason
                                                                  else ""),
          evidence=figures)


def launcher_failure(rd: RunDir, rank: int, returncode: int, attempt: int = 1,
                     stopped: tuple[int, ...] = ()) -> None:
    """The --local launcher's stop/hang event (train/job_watch.py: record_failure)."""
    codes = [3] * WORLD
    codes[rank] = returncode
    result = JobResult(code=3, returncodes=codes, failed_rank=rank,
                       alive_at_failure=[r for r in range(WORLD) if r != rank],
                       stopped_at_failure=list(stopped))
    record_failure(rd, load_checked_plan(str(PLANS / "cpu-tiny.yaml")), result,
                   f"local-{attempt}", rd.path("logs"), read_error_files(rd),
                   started=0.0)  # the simulated records' clock starts near 0


def once(cli, rd: RunDir, *args: str) -> tuple[int, list[str], str]:
    """`mscale watch RUN --once --no-act`: exit code, stdout lines, stderr."""
    code, out, err = cli("watch", rd.root, "--once", "--no-act", *args)
    return code, out.splitlines(), err


def verdict(cli, rd: RunDir) -> dict:
    """The same read as ``--json``: the document, its exit code checked against the process's."""
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--json")
    doc = json.loads(out)
    assert doc["exit_code"] == code, err
    return doc


def follower(rd: RunDir, report_end: bool) -> Follower:
    """A live follower of ``rd`` with the real feeds, a judge that finds nothing and no outputs:
    what it makes of the job's end alone."""
    target = resolve_target(rd.root)
    return Follower(target=target, layout_for=layout_source(target),
                    make_watcher=lambda layout: QuietJudge(), feed=MetricsFeed(rd.metrics),
                    events=EventFeed(rd.events), to_window=records_to_window,
                    actor=Actor(rd, ActionConfig(act=False)), outputs=NoOutputs(), live=True,
                    report_end=report_end)


class QuietJudge:
    """A judge that finds nothing: these tests look at the end alone."""

    last_step = None
    escalated: list = []
    cleared: list = []

    def feed(self, window):
        self.last_step = int(window.steps[-1])
        return []

    def check_hang(self, now, last, attempt_start=None):
        return []

    def open_findings(self):
        return []

    def summary(self):
        return {"worst": "ok", "worst_open": "ok", "emitted": {}, "open": 0}


class NoOutputs:
    """Outputs that show nothing."""

    def poll(self, follower, window, new):
        pass
