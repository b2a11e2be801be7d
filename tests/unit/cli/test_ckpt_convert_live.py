"""`mscale ckpt convert` does not write into a run directory a live job holds (its real
``lock.json``, runs/lock.py's rule): one error line naming the run and the fix, exit 3, nothing
created — while the same conversion into a stopped run (a stale lock of a dead pid, or none)
goes ahead, and a DEST outside the live run is fine."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest

from mscale.ckpt import catalog
from mscale.runs.lock import RunLock

from tests.unit.ckpt.hostile import copy_run, run_with_plan
from tests.unit.recover.test_live_run import start_holder


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return run_with_plan(tmp_path_factory.mktemp("good"))


@pytest.fixture
def src(good, tmp_path):
    """Another run's checkpoints (the weights to convert)."""
    return copy_run(good, tmp_path / "other")


@pytest.fixture
def live(good, tmp_path):
    """The run being trained: a copy whose step-000005 is the latest."""
    run = copy_run(good, tmp_path / "live")
    (run / "ckpt" / "step-000002").rename(tmp_path / "spare-step-2")
    return run


def refusal(err: str, run, pid: int) -> bool:
    lines = err.splitlines()
    return (len(lines) == 1 and lines[0].startswith(
        f"error: {run} is in use by a running job (pid {pid} on {socket.gethostname()}, "
        "heartbeat ")
        and f"ckpt convert does not write into a live run; stop the job first (touch "
            f"{run}/control/halt) or write " in lines[0])


def test_into_a_live_runs_ckpt_is_refused_with_one_line(cli, good, src, live, tmp_path):
    dst = live / "ckpt" / "step-000005x"
    lock = RunLock(str(live), "training").acquire()
    try:
        for args in ([str(live / "ckpt" / "step-000013")], [str(dst)],
                     [str(live / "export" / "hf"), "--to-hf"]):
            extra = [] if "--to-hf" in args else ["--plan", str(good.parent / "plan.yaml")]
            code, out, err = cli("ckpt", "convert", str(src), *args, *extra)
            assert code == 3 and refusal(err, live, os.getpid()), err
            assert not os.path.exists(args[0])
        assert catalog.read_latest(str(live / "ckpt")) == "step-000005"
        assert not (live / "export").exists()
        code, out, err = cli("ckpt", "convert", str(src), str(live / "ckpt" / "step-000002"),
                             "--plan", str(good.parent / "plan.yaml"), "--json")
        assert code == 3 and "is in use by a running job" in json.loads(out)["error"]["message"]
    finally:
        lock.release()


def test_a_relative_dest_names_the_run_as_given(cli, good, src, live, monkeypatch):
    monkeypatch.chdir(live.parent)
    lock = RunLock(str(live), "training").acquire()
    try:
        code, out, err = cli("ckpt", "convert", str(src), "live/ckpt/step-000005y", "--plan",
                             str(good.parent / "plan.yaml"))
        assert code == 3 and refusal(err, "live", os.getpid()), err
    finally:
        lock.release()


def test_a_child_jobs_lock_refuses_until_the_job_is_dead(cli, good, src, live, tmp_path):
    holder = start_holder(live, tmp_path)
    try:
        dst = live / "ckpt" / "step-000002"
        code, out, err = cli("ckpt", "convert", str(src), str(dst), "--plan",
                             str(good.parent / "plan.yaml"))
        assert code == 3 and refusal(err, live, holder.pid), err
        assert not dst.exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert (live / "lock.json").exists()  # left behind with a dead pid: stale
        code, out, err = cli("ckpt", "convert", str(src / "ckpt" / "step-000002"), str(dst),
                             "--plan", str(good.parent / "plan.yaml"))
        assert code == 0, out + err
        assert (dst / "COMMITTED").exists()
        assert catalog.read_latest(str(live / "ckpt")) == "step-000005"  # never backwards
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def test_outside_the_live_run_is_fine(cli, good, src, live, tmp_path):
    lock = RunLock(str(live), "training").acquire()
    try:
        code, out, err = cli("ckpt", "convert", str(src), str(tmp_path / "elsewhere"),
                             "--plan", str(good.parent / "plan.yaml"))
        assert code == 0, out + err
    finally:
        lock.release()


def test_a_foreign_lock_json_above_dest_says_nothing_about_a_run(cli, good, src, tmp_path):
    """Some other tool's lock.json in a parent directory is not a run's lock: passed over."""
    (tmp_path / "lock.json").write_text('{"lockfileVersion": 3}')
    code, out, err = cli("ckpt", "convert", str(src), str(tmp_path / "out"), "--plan",
                         str(good.parent / "plan.yaml"))
    assert code == 0, out + err


def test_another_hosts_fresh_lock_is_live(cli, good, src, live):
    now = time.time()
    (live / "lock.json").write_text(json.dumps({
        "run_id": "slurm-9", "host": "gpu-node-17", "pid": 4242, "since": now - 100,
        "heartbeat": now - 3, "lease_s": 120.0, "token": "x" * 32}))
    code, out, err = cli("ckpt", "convert", str(src), str(live / "ckpt" / "step-000002"),
                         "--plan", str(good.parent / "plan.yaml"))
    assert code == 3 and re.search(r"\(pid 4242 on gpu-node-17, heartbeat \d+ s ago\)", err), err


def test_the_halt_to_touch_is_quoted_for_the_shell(cli, good, src, tmp_path):
    """`touch my run/control/halt`, pasted from the refusal, touches two other files and stops
    nothing."""
    live = copy_run(good, tmp_path / "my run")
    lock = RunLock(str(live), "training").acquire()
    try:
        code, _, err = cli("ckpt", "convert", str(src), str(live / "ckpt" / "step-000013"),
                           "--plan", str(good.parent / "plan.yaml"))
        assert code == 3 and f"(touch '{live}/control/halt')" in err, err
    finally:
        lock.release()
