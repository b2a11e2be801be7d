"""Faults a real `mscale train --local` job must survive with a trace recover can read.

A killed rank, a stopped (hung) rank, a halt request made as a directory, a worker that cannot
rendezvous, a full disk: each ends with a contract exit code, one console line saying why, and a
record in events.jsonl naming the rank and node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PLANS, REPO
from tests.e2e.train_run import MSCALE, mscale, records, small_plan

pytestmark = pytest.mark.e2e


def start(tmp_path: Path, run: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([MSCALE, "train", small_plan(tmp_path), "--local", "4",
                             "--run-dir", str(run), *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_steps(proc: subprocess.Popen, run: Path, n: int) -> None:
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)


def worker_pid(run: Path, rank: int) -> int:
    """The pid of this run's worker ``rank`` (its environment names the run directory)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(
                e.startswith(b"MSCALE_TRAIN_OPTIONS=") and str(run).encode() in e for e in env):
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} for {run}")


def test_kill_9_names_the_rank_node_and_signal(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500")
    wait_for_steps(proc, run, 2)
    os.kill(worker_pid(run, 2), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    stop = records(run / "events.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["ranks"] == [2] and stop["nodes"] == ["node2"]
    assert stop["evidence"]["how"] == "killed by SIGKILL"
    assert "rank 2 on node2 killed by SIGKILL first" in out
    assert "Traceback" not in out


def test_sigstop_is_named_as_the_hung_rank_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500", "--timeout", "4")
    wait_for_steps(proc, run, 2)
    pid = worker_pid(run, 1)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 3, out
    hang = records(run / "events.jsonl")[-1]
    assert hang["kind"] == "hang" and hang["ranks"] == [1], hang
    assert 1 in hang["evidence"]["stopped_at_failure"] and hang["evidence"]["timed_out"]
    errors = [json.loads((run / "logs" / f"rank{r}.error.json").read_text())
              for r in hang["evidence"]["timed_out"]]
    assert all(e["kind"] == "timeout" for e in errors)
    assert "rank(s) 1 on node1 stopped answering" in out


def test_halt_as_a_directory_then_resume_with_a_json_summary(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500")
    wait_for_steps(proc, run, 2)
    (run / "control" / "halt").mkdir()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "halt requested through control/halt" in out and "Traceback" not in out
    halted = records(run / "metrics.jsonl")[-1]["step"]
    assert not (run / "control" / "halt").exists()
    ckpt = f"ckpt/step-{halted:06d}"
    assert (run / ckpt / "COMMITTED").exists()

    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run),
               "--steps", str(halted + 2), "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)  # stdout is one JSON document; the human lines went to stderr
    assert doc["code"] == 0 and doc["summary"]["first_step"] == halted
    assert doc["summary"]["last_step"] == halted + 2
    assert f"resumed from {run / ckpt} (step {halted})" in p.stderr
    assert "attempt 2" in p.stderr
    log0 = (run / "logs" / "rank0.log").read_text()
    assert "resumed from" in log0 and "done:" in log0  # rank 0's log is written, not empty
    starts = [e for e in records(run / "events.jsonl") if e["kind"] == "start"]
    assert [s["evidence"]["attempt"] for s in starts] == [1, 2]
    assert starts[0]["evidence"]["run_id"] != starts[1]["evidence"]["run_id"]
    assert sorted(os.listdir(run / "plans")) == ["plan-0001.yaml", "plan-0002.yaml"]


def test_a_second_job_on_the_same_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500")
    try:
        wait_for_steps(proc, run, 1)
        p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run))
        assert p.returncode == 3 and "Traceback" not in p.stderr
        assert "run directory is in use" in p.stderr and "lock.json" in p.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert proc.returncode == 1


def test_another_model_is_refused_in_a_used_run_directory(tmp_path):
    run = tmp_path / "run"
    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run), "--steps",
               "1", "--no-final-ckpt")
    assert p.returncode == 0, p.stdout + p.stderr
    other = Path(small_plan(tmp_path))
    other.write_text(other.read_text().replace("seed: 1234", "seed: 99"))
    p = mscale("train", str(other), "--local", "4", "--run-dir", str(run))
    assert p.returncode == 3 and "training.seed" in p.stderr and "--run-dir" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_worker_that_cannot_rendezvous_exits_3_with_an_error_file(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, RANK="1", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29987")
    p = subprocess.run([MSCALE, "train", str(PLANS / "cpu-tiny.yaml"), "--timeout", "3",
                        "--run-dir", str(run)], cwd=REPO, env=env, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "error (rank 1" in p.stderr
    err = json.loads((run / "logs" / "rank1.error.json").read_text())
    assert err["rank"] == 1 and err["kind"] in ("timeout", "network") and err["traceback"]


@pytest.mark.parametrize("args, needle", [
    (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"),
    (["--timeout", "0"], "--timeout"), (["--timeout", "-5"], "--timeout"),
    (["--log-interval", "0"], "--log-interval"), (["--local", "-1"], "--local"),
])
def test_bad_numbers_fail_before_any_worker(tmp_path, args, needle):
    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(tmp_path / "r"),
               *args, timeout=60)
    assert p.returncode == 3 and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()


def test_run_dir_is_required_with_a_plan_and_must_be_writable(tmp_path):
    p = mscale("train", small_plan(tmp_path), "--local", "4", timeout=60)
    assert p.returncode == 3 and "--run-dir is required" in p.stderr
    (tmp_path / "file").write_text("x")
    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir",
               str(tmp_path / "file" / "run"), timeout=60)
    assert p.returncode == 3 and "is a file" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_during_metrics_stops_cleanly(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run),
                   "--steps", "2000", "--no-final-ckpt", "--ckpt-interval", "100000",
                   "--log-interval", "1000", timeout=600)
        assert p.returncode == 3, p.stdout + p.stderr
        assert "the disk is full" in p.stdout and "Traceback" not in p.stdout + p.stderr
        lines = (run / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]  # no torn line anywhere
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 2000
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
