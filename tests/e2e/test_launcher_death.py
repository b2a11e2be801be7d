"""The ``--local`` launcher's own end, with the real binary on two processes.

- SIGKILL to the launcher: every worker stops within seconds (a worker never outlives its
  launcher), each leaves an error file of kind ``launcher_died``, rank 0 a ``stop`` event, and
  recover reads no network or node fault in them.
- SIGHUP to the launcher: a stop request like SIGTERM (checkpoint, then exit 1).
- A closed session: the console's reader goes away (training goes on, rank 0's log keeps
  growing), then the hangup reaches the whole process group: a checkpoint and exit 1.
- Ctrl-C (SIGINT to the whole process group, launcher and workers alike): a checkpoint and exit
  1, said as the operator's stop; not "rank N exited 130" as it was.

Every wait polls a file or a process state against a deadline; none sleeps on the clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from mscale.distributed.launch import pid_file
from tests.conftest import PLANS, REPO
from tests.e2e.train_run import MSCALE, records

pytestmark = pytest.mark.e2e

START_DEADLINE_S = 120
"""Two workers importing torch on a loaded two-core machine: far above the ~5 s it takes."""
GONE_DEADLINE_S = 10
"""The workers are gone within this after the launcher (~0.1 s measured): a few seconds."""
STOP_DEADLINE_S = 120
"""A halt at the next step boundary, the checkpoint and the exit."""


def two_process_plan(tmp_path: Path) -> str:
    """cpu-tiny on two 1-process nodes (dp 2): the smallest job with a peer on another node."""
    data = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    data["cluster"].update(hostlist="node[1-2]", gpus_per_node=1)
    data["layout"].update(tp=1, pp=1, dp=2, micro_batch=8, sequence_parallel=False)
    data["training"]["micro_batch"] = 8
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _as_from_a_terminal() -> None:
    """The job's signals as a terminal leaves them: the test runner may run under nohup
    (SIGHUP ignored, and inherited) or with SIGINT ignored (a background job of a shell)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """``mscale train PLAN --local 2`` in its own session (its process group is the job's)."""

    def __init__(self, tmp_path: Path, stdout=subprocess.DEVNULL):
        self.run = tmp_path / "run"
        self.proc = subprocess.Popen(
            [MSCALE, "train", two_process_plan(tmp_path), "--local", "2", "--run-dir",
             str(self.run), "--steps", "100000", "--log-interval", "1"],
            cwd=REPO, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_as_from_a_terminal)
        self.workers: list[int] = []

    def steps(self) -> int:
        metrics = self.run / "metrics.jsonl"
        return metrics.read_text().count("\n") if metrics.exists() else 0

    def wait_for_steps(self, n: int) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while self.steps() < n:
            assert self.proc.poll() is None, f"the job ended ({self.proc.returncode})"
            assert time.monotonic() < deadline, f"fewer than {n} steps in {START_DEADLINE_S} s"
            time.sleep(0.1)
        logs = str(self.run / "logs")
        self.workers = [int(Path(pid_file(logs, r)).read_text()) for r in range(2)]

    def kill_all(self) -> None:
        """Whatever is left (a failing test): the group, and the workers by their pids."""
        for pid in self.workers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def gone(pid: int) -> bool:
    """The process has ended (a zombie has: only its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_workers_stop_within_seconds_when_the_launcher_is_sigkilled(tmp_path):
    job = Job(tmp_path)
    try:
        job.wait_for_steps(3)
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=30)
        killed = time.monotonic()
        while not all(gone(pid) for pid in job.workers):
            assert time.monotonic() - killed < GONE_DEADLINE_S, \
                f"workers still running {GONE_DEADLINE_S} s after their launcher died"
            time.sleep(0.02)
    finally:
        job.kill_all()
    logs = job.run / "logs"
    for rank in range(2):
        err = json.loads((logs / f"rank{rank}.error.json").read_text())
        assert err["kind"] == "launcher_died", err
        assert err["node"] == f"node{rank + 1}" and "launcher is gone" in err["message"]
        assert f"error (rank {rank} on node{rank + 1}, launcher_died)" in \
            (logs / f"rank{rank}.log").read_text()
    stop = records(job.run / "events.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["evidence"]["kind"] == "launcher_died", stop
    # recover must not read a network or node fault into it (it used to: "broken pipe")
    p = subprocess.run([MSCALE, "recover", str(job.run), "--json"], cwd=REPO, text=True,
                       capture_output=True, timeout=120)
    diagnosis = json.loads(p.stdout)["diagnosis"]
    assert diagnosis["cls"] != "network" and not diagnosis["suspect_nodes"], diagnosis


def _assert_clean_stop(job: Job) -> None:
    events = records(job.run / "events.jsonl")
    stop = events[-1]
    assert stop["kind"] == "stop" and stop["evidence"]["code"] == 1, stop
    assert stop["evidence"]["reason"] == "signal"
    step = stop["step"]
    assert any(e["kind"] == "checkpoint" and e["step"] == step for e in events), events
    assert (job.run / "ckpt" / f"step-{step:06d}" / "COMMITTED").exists()
    assert not list((job.run / "logs").glob("rank*.error.json"))


def test_sighup_to_the_launcher_checkpoints_and_stops_like_sigterm(tmp_path):
    job = Job(tmp_path)
    try:
        job.wait_for_steps(3)
        job.proc.send_signal(signal.SIGHUP)
        assert job.proc.wait(timeout=STOP_DEADLINE_S) == 1
    finally:
        job.kill_all()
    _assert_clean_stop(job)


def test_a_closed_session_trains_on_without_its_console_then_stops_on_the_hangup(tmp_path):
    """What an ssh session that closes does: the console's reader goes away, then SIGHUP
    reaches the terminal's whole process group (launcher, fork server, workers)."""
    job = Job(tmp_path, stdout=subprocess.PIPE)
    try:
        job.wait_for_steps(3)
        job.proc.stdout.close()  # the reader of the console is gone: writes to it fail
        closed_at = job.steps()
        job.wait_for_steps(closed_at + 5)  # and training goes on, every step printed
        os.killpg(job.proc.pid, signal.SIGHUP)
        assert job.proc.wait(timeout=STOP_DEADLINE_S) == 1
    finally:
        job.kill_all()
    _assert_clean_stop(job)
    rank0 = (job.run / "logs" / "rank0.log").read_text()
    assert f"step {closed_at + 5}/100000" in rank0  # its log kept every line
    assert "Traceback" not in rank0


def test_ctrl_c_checkpoints_and_stops_as_the_operators_request(tmp_path):
    console = tmp_path / "console.txt"
    with open(console, "w") as out:
        job = Job(tmp_path, stdout=out)
    try:
        job.wait_for_steps(3)
        os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert job.proc.wait(timeout=STOP_DEADLINE_S) == 1, console.read_text()[-2000:]
    finally:
        job.kill_all()
    _assert_clean_stop(job)
    assert records(job.run / "events.jsonl")[-1]["evidence"]["signal"] == "SIGINT"
    text = console.read_text()
    assert "stop requested (SIGINT): every worker saves a checkpoint" in text
    assert "a stop signal (SIGINT) asked the job to halt" in text
    assert "Traceback" not in text and "interrupted" not in text
