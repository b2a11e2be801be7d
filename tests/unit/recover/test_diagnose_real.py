"""diagnose() on run directories that real `mscale train --local 4` jobs left: a NaN, a rank
killed with SIGKILL then a resumed attempt that finished, a rank stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mscale.recover.diagnose import diagnose
from tests.conftest import REPO
from tests.e2e.train_run import MSCALE, small_plan

pytestmark = pytest.mark.e2e


def train(tmp_path: Path, run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([MSCALE, "train", small_plan(tmp_path), "--local", "4",
                             "--run-dir", str(run), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_steps(proc: subprocess.Popen, run: Path, n: int) -> None:
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)


def worker(run: Path, rank: int) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(
                e.startswith(b"MSCALE_TRAIN_OPTIONS=") and str(run).encode() in e for e in env):
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} for {run}")


def test_a_real_nan(tmp_path):
    run = tmp_path / "run"
    proc = train(tmp_path, run, "--steps", "6", "--inject-nan", "3")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out
    d = diagnose(str(run))
    assert (d.cls, d.symptom, d.bad_step, d.failed_step, d.exit_code) == \
        ("numerics", "nan", 3, 2, 2)


def test_a_real_kill_then_a_resumed_attempt(tmp_path):
    run = tmp_path / "run"
    proc = train(tmp_path, run, "--steps", "300", "--ckpt-interval", "2")
    wait_steps(proc, run, 3)
    os.kill(worker(run, 2), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    d = diagnose(str(run))
    assert (d.cls, d.symptom, d.attempt, d.exit_code) == ("unknown", "signal", 1, 3), d
    assert d.suspect_ranks == [2] and d.suspect_nodes == ["node2"]
    again = train(tmp_path, run, "--steps", "6")
    out, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out
    d = diagnose(str(run))  # the first attempt's error files are still on disk
    assert (d.cls, d.symptom, d.attempt, d.failed_step) == ("none", "finished", 2, 6)


def test_a_real_sigstop_names_the_stopped_rank(tmp_path):
    run = tmp_path / "run"
    proc = train(tmp_path, run, "--steps", "300", "--timeout", "4")
    wait_steps(proc, run, 2)
    pid = worker(run, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 3, out
    d = diagnose(str(run))
    assert (d.symptom, d.suspect_ranks, d.suspect_nodes) == ("hang", [1], ["node1"]), d
    assert all(e.rank != 1 for e in d.evidence if e.source.endswith("error.json"))
