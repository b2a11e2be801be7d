"""Faults a real `mscale train --local` job must survive with a trace recover can read.

A killed rank, a stopped (hung) rank, a halt request made as a directory, a worker that cannot
rendezvous, a full disk: each ends with a contract exit code, one console line saying why, and a
record in events.jsonl naming the rank and node.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mscale.distributed.launch import pid_file
from tests.conftest import PLANS, REPO, small_tmpfs
from tests.e2e.train_run import (HANG_GUARD_S, MSCALE, assert_timed_out_after, mscale, records,
                                 small_plan)

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
    """The pid of this run's worker ``rank``: the launcher writes it to ``logs/rank<N>.pid``."""
    try:
        return int(Path(pid_file(str(run / "logs"), rank)).read_text())
    except (OSError, ValueError):
        raise AssertionError(f"no worker of rank {rank} for {run}") from None


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
    # said as soon as it was seen, before the others had stopped and the closing line
    assert "rank 2 on node2 killed by SIGKILL; stopping the other workers" in out
    assert "Traceback" not in out


def test_sigstop_is_named_as_the_hung_rank_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500", "--timeout", "4")
    wait_for_steps(proc, run, 2)
    pid = worker_pid(run, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None
    assert proc.returncode == 3, out
    assert_timed_out_after(run, 4)
    hang = records(run / "events.jsonl")[-1]
    assert hang["kind"] == "hang" and hang["ranks"] == [1], hang
    assert 1 in hang["evidence"]["stopped_at_failure"] and hang["evidence"]["timed_out"]
    errors = [json.loads((run / "logs" / f"rank{r}.error.json").read_text())
              for r in hang["evidence"]["timed_out"]]
    assert all(e["kind"] == "timeout" for e in errors)
    assert "rank(s) 1 on node1 stopped answering" in out


def test_a_second_job_is_refused_then_a_halt_as_a_directory_and_a_json_resume(tmp_path):
    """One job for two checks (each job start costs seconds of CPU): while it runs, a second
    job on its run directory is refused; then it is halted and resumed."""
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "500")
    try:
        wait_for_steps(proc, run, 1)
        p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run))
        assert p.returncode == 3 and "Traceback" not in p.stderr
        assert "run directory is in use" in p.stderr and "lock.json" in p.stderr
        wait_for_steps(proc, run, 2)
    except BaseException:
        proc.kill()
        raise
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


def test_the_start_event_records_the_launch_and_another_model_is_refused_there(tmp_path):
    run = tmp_path / "run"
    plan = small_plan(tmp_path)
    p = mscale("train", plan, "--local", "4", "--run-dir", str(run), "--steps", "1",
               "--no-final-ckpt")
    assert p.returncode == 0, p.stdout + p.stderr
    [start] = [e for e in records(run / "events.jsonl") if e["kind"] == "start"]
    launch = start["evidence"]["launch"]
    assert launch["argv"][1:] == ["train", plan, "--local", "4", "--run-dir", str(run),
                                  "--steps", "1", "--no-final-ckpt"]
    assert launch["cwd"] == str(REPO) and launch["plan"] == plan and launch["local"] == 4
    assert launch["nodes"] == ["node1", "node2"]

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
               *args, timeout=180)
    assert p.returncode == 3 and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r").exists()


def test_run_dir_is_required_with_a_plan_and_must_be_writable(tmp_path):
    p = mscale("train", small_plan(tmp_path), "--local", "4", timeout=180)
    assert p.returncode == 3 and "--run-dir is required" in p.stderr
    (tmp_path / "file").write_text("x")
    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir",
               str(tmp_path / "file" / "run"), timeout=180)
    assert p.returncode == 3 and "is a file" in p.stderr and "Traceback" not in p.stderr


def test_a_full_disk_during_metrics_stops_cleanly(tmp_path):
    """A real 96 KiB tmpfs fills while rank 0 appends metrics: exit 3, one line, no torn
    record. Mounting needs root: skipped without, failed in CI (tests/conftest.py)."""
    with small_tmpfs(tmp_path / "disk", "96k") as disk:
        _stops_cleanly_when_the_metrics_fill(tmp_path, disk)


def _stops_cleanly_when_the_metrics_fill(tmp_path: Path, disk: Path) -> None:
    run = disk / "run"
    stop = threading.Event()

    def fill_once_training_writes_metrics() -> None:
        """Take all but two pages of the disk once steps are being recorded: the disk fills
        during the metrics a few steps later, not after minutes of 850-byte lines."""
        metrics = run / "metrics.jsonl"
        while not stop.is_set():
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                with open(disk / "filler", "wb", buffering=0) as f:  # nothing left to flush
                    try:
                        while True:
                            f.write(b"x" * 4096)
                    except OSError as e:  # the disk is full: what this writes for
                        if e.errno != errno.ENOSPC:
                            raise
                    f.truncate(max(0, f.tell() - 8192))
                return
            time.sleep(0.05)

    filler = threading.Thread(target=fill_once_training_writes_metrics)
    filler.start()
    try:
        p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run),
                   "--steps", "2000", "--no-final-ckpt", "--ckpt-interval", "100000",
                   "--log-interval", "1000", timeout=600)
        stop.set()
        filler.join()
        assert p.returncode == 3, p.stdout + p.stderr
        assert "the disk is full" in p.stdout and "Traceback" not in p.stdout + p.stderr
        assert "failed: rank" not in p.stdout  # an agreed stop: no rank (nor node) failed first
        lines = (run / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]  # no torn line anywhere
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 2000
    finally:
        stop.set()
        filler.join()


# ---------------------------------------------------------------- fault hooks (attempt 1 only)
def losses(run: Path) -> dict[int, float]:
    """Step → loss of every metrics record (a resumed run's later records win)."""
    return {m["step"]: m["loss"] for m in records(run / "metrics.jsonl")}


def hooked(tmp_path: Path, run: Path, *args: str, timeout: float = 180):
    return mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run), *args,
                  timeout=timeout)


def test_inject_crash_kills_mid_step_once_and_the_relaunch_matches_a_clean_run(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    args = ("--steps", "5", "--ckpt-interval", "2")
    assert hooked(tmp_path, ref, *args).returncode == 0
    p = hooked(tmp_path, run, *args, "--inject-crash", "2:4")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "rank 2 on node2 killed by SIGKILL first" in p.stdout and "Traceback" not in p.stdout
    stop = records(run / "events.jsonl")[-1]
    assert stop["kind"] == "stop" and stop["ranks"] == [2]
    assert max(losses(run)) == 3  # step 4 never completed
    p = hooked(tmp_path, run, *args, "--inject-crash", "2:4")  # the same command again
    assert p.returncode == 0, p.stdout + p.stderr
    assert "test hooks (--inject-*) are off: this is attempt 2" in p.stdout
    assert "resumed from" in p.stdout and "(step 2)" in p.stdout
    assert losses(run) == losses(ref)


def test_inject_hang_is_named_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    p = hooked(tmp_path, run, "--steps", "50", "--timeout", "4", "--inject-hang", "1:3",
               timeout=HANG_GUARD_S)
    assert p.returncode == 3, p.stdout + p.stderr
    assert_timed_out_after(run, 4)
    hang = records(run / "events.jsonl")[-1]
    assert hang["kind"] == "hang" and hang["ranks"] == [1]
    assert hang["evidence"]["stopped_at_failure"] == [1]
    assert "rank(s) 1 on node1 stopped answering (process stopped)" in p.stdout


def test_inject_ckpt_kill_leaves_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = hooked(tmp_path, run, "--steps", "6", "--ckpt-interval", "2", "--inject-ckpt-kill", "3:4")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "rank 3 on node2 killed by SIGKILL first" in p.stdout
    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert (ckpt / "step-000004" / "rank-00003.bin").exists()  # the partial shard, flushed
    assert not (ckpt / "step-000004" / "COMMITTED").exists()
    assert "--inject-ckpt-kill: this rank SIGKILLs itself" in (run / "logs" / "rank3.log").read_text()


def test_inject_ckpt_enospc_stops_the_job_with_latest_intact_then_resumes(tmp_path):
    run = tmp_path / "run"
    args = ("--steps", "6", "--ckpt-interval", "2", "--inject-ckpt-enospc", "4")
    p = hooked(tmp_path, run, *args)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "the disk is full" in p.stdout and "Traceback" not in p.stdout + p.stderr
    events = records(run / "events.jsonl")
    [failed] = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert failed["step"] == 4 and sorted(failed["ranks"]) == [0, 1, 2, 3]
    assert "No space left on device" in failed["message"] and "job stops" in failed["message"]
    [stop] = [e for e in events if e["kind"] == "stop" and "code" in e["evidence"]]
    assert stop["evidence"]["code"] == 3 and stop["evidence"]["reason"] == "abort"
    assert max(losses(run)) < 6
    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert not (ckpt / "step-000004").exists()  # the failed attempt is removed
    p = hooked(tmp_path, run, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (ckpt / "latest").read_text().strip() == "step-000006"


def test_a_failed_final_save_is_exit_3_and_recover_does_not_call_the_run_finished(tmp_path):
    """A storage error that is not a full disk: training goes on after a failed save, but the
    run's last save failing loses every step since ``latest`` with the process, so the job says
    so and exits 3; recover resumes from ``latest``; the same command then finishes."""
    run = tmp_path / "run"
    args = ("--steps", "4", "--ckpt-interval", "2", "--inject-ckpt-eio", "4")
    p = hooked(tmp_path, run, *args)
    assert p.returncode == 3, p.stdout + p.stderr
    line = ("stopped at step 4: checkpoint step-000004 failed on 4 rank(s): OSError: [Errno 5] "
            "Input/output error")
    assert line in p.stdout and "latest stays step-000002: the steps after it are not saved" \
        in p.stdout and "Traceback" not in p.stdout + p.stderr, p.stdout
    [stop] = [e for e in records(run / "events.jsonl") if e["kind"] == "stop"]  # rank 0's only
    assert stop["evidence"]["code"] == 3 and stop["evidence"]["reason"] == "abort"
    assert "failed: rank" not in p.stdout  # an agreed stop: the launcher blames no rank
    r = mscale("recover", str(run), "--json")
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "relaunchable" and doc["diagnosis"]["cls"] == "storage", r.stdout
    assert doc["checkpoint"]["step"] == 2 and doc["exclusions"]["nodes"] == [], r.stdout
    p = hooked(tmp_path, run, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (run / "ckpt" / "latest").read_text().strip() == "step-000004"


def test_a_halt_whose_save_fails_says_so_and_is_exit_3(tmp_path):
    run = tmp_path / "run"
    (run / "control" / "halt").mkdir(parents=True)
    p = hooked(tmp_path, run, "--steps", "4", "--inject-ckpt-eio", "1")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "stopped at step 1: checkpoint step-000001 failed" in p.stdout, p.stdout
    assert "latest stays (none yet)" in p.stdout and "a checkpoint is saved" not in p.stdout


def test_inject_nan_fires_in_attempt_1_only(tmp_path):
    run = tmp_path / "run"
    args = ("--steps", "3", "--inject-nan", "2", "--no-final-ckpt")
    assert hooked(tmp_path, run, *args).returncode == 2
    p = hooked(tmp_path, run, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert max(losses(run)) == 3


def test_a_rank_stopped_inside_a_checkpoint_write_fails_the_job_within_the_timeout(tmp_path):
    """The checkpoint's own group has --timeout too: rank 1 stops while writing the final save,
    the others finish theirs and wait for it in the commit's collective."""
    run = tmp_path / "run"
    p = hooked(tmp_path, run, "--steps", "3", "--timeout", "4", "--ckpt-interval", "100",
               "--inject-ckpt-hang", "1:3", timeout=HANG_GUARD_S)
    assert p.returncode == 3, p.stdout + p.stderr
    assert_timed_out_after(run, 4)
    hang = records(run / "events.jsonl")[-1]
    assert hang["kind"] == "hang" and hang["ranks"] == [1], hang
    assert hang["evidence"]["stopped_at_failure"] == [1]
    # the ranks waiting for rank 1 in the commit's collective: each times out, unless the launcher
    # stops it first once one has (which ones get there first depends on the machine's load:
    # [0, 2] was seen beside another 8-process job)
    timed_out = hang["evidence"]["timed_out"]
    assert hang["evidence"]["first_failed_rank"] in timed_out and set(timed_out) <= {0, 2, 3}
    assert not (run / "ckpt" / "step-000003" / "COMMITTED").exists()
    log = (run / "logs" / "rank1.log").read_text()
    assert "--inject-ckpt-hang: this rank SIGSTOPs itself" in log


def token_plan(tmp_path: Path, name: str, tokens) -> str:
    """The small plan reading ``tokens`` (uint16) from a file of its own, in file order (cutting
    samples out of a shuffled source would reshuffle the rest)."""
    import numpy as np
    import yaml

    data_file = tmp_path / f"{name}.bin"
    np.asarray(tokens, dtype=np.uint16).tofile(data_file)
    plan = Path(small_plan(tmp_path))
    doc = yaml.safe_load(plan.read_text())
    doc["training"]["data"] = {"kind": "tokens", "path": str(data_file), "dtype": "uint16",
                               "shuffle": False}
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(doc))
    return str(out)


def test_a_data_skip_equals_a_run_on_data_with_that_window_cut_out(tmp_path):
    import numpy as np

    step = 16 * 64  # tokens per step: global batch × seq_len; sample k is tokens[64k : 64k + 65]
    tokens = np.random.default_rng(0).integers(0, 256, 8 * step + 1)
    tokens[3 * step] = tokens[step]  # the token after step 1's last sample, in both files
    cut = np.concatenate([tokens[:step], tokens[3 * step:]])  # steps 2-3's samples removed
    skipping, shifted = tmp_path / "skipping", tmp_path / "shifted"
    skipping.mkdir()
    (skipping / "data_skip.json").write_text(json.dumps(
        {"entries": [{"after_step": 1, "skip_steps": 2, "reason": "a spike at step 3"}]}))
    args = ("--local", "4", "--steps", "4", "--no-final-ckpt")
    p = mscale("train", token_plan(tmp_path, "full", tokens), "--run-dir", str(skipping), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skipping data: after step 1, the next 2 step(s)' samples (a spike at step 3)" in p.stdout
    [info] = [e for e in records(skipping / "events.jsonl") if e["kind"] == "info"]
    assert info["evidence"]["data_skip"]["entries"][0]["skip_steps"] == 2
    p = mscale("train", token_plan(tmp_path, "cut", cut), "--run-dir", str(shifted), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert losses(skipping) == losses(shifted) and len(losses(shifted)) == 4
    plain = tmp_path / "plain"
    p = mscale("train", token_plan(tmp_path, "full", tokens), "--run-dir", str(plain), *args)
    assert losses(plain)[1] == losses(skipping)[1] and losses(plain)[2] != losses(skipping)[2]


def test_a_damaged_data_skip_file_is_named_exit_3(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "data_skip.json").write_text('{"entries": [{"after_step": -1}]}')
    p = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run), "--steps",
               "1", "--no-final-ckpt")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "data_skip.json" in p.stdout + p.stderr and "Traceback" not in p.stdout + p.stderr


def test_a_rank_stopped_at_start_up_is_named_within_the_timeout(tmp_path):
    """Stopped as soon as it exists (before or during the rendezvous, whichever the machine's
    speed gives): its peers' init_process_group or first collective times out all the same."""
    run = tmp_path / "run"
    proc = start(tmp_path, run, "--steps", "5", "--timeout", "4")
    deadline = time.monotonic() + 60
    while True:
        try:
            pid = worker_pid(run, 3)
            break
        except AssertionError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None
    assert proc.returncode == 3, out
    assert_timed_out_after(run, 4, at_connect=True)
    # the whole console on failure (pytest elides a long string's middle, the line that matters)
    assert "rank(s) 3 on node2 stopped answering (process stopped)" in out, \
        out + "".join(f"\n{p.name}: {p.read_text()[-1500:]}"
                      for p in sorted((run / "logs").glob("rank*.error.json")))
    assert not (run / "metrics.jsonl").exists() or not records(run / "metrics.jsonl")
