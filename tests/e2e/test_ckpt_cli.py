"""Checkpoints through the real `mscale` binary: an interrupted run (a clean stop, a kill -9
during a background write) resumed to the end gives exactly the losses of a straight run; a full
checkpoint filesystem; damaged checkpoints; the ckpt CLI. Four gloo processes (tp 2 x dp 2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, small_tmpfs
from tests.e2e.train_run import MSCALE, mscale, records
from tests.e2e.train_run import small_plan as plan4, text_data, text_plan

pytestmark = pytest.mark.e2e


def losses(run: Path) -> dict[int, tuple[float, float]]:
    """Step → (loss, grad norm); the last record wins (a killed run repeats steps)."""
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in records(run / "metrics.jsonl")}


def eval_losses(run: Path) -> dict[int, float]:
    """Step → held-out loss, for the steps that evaluated."""
    return {m["step"]: m["eval_loss"] for m in records(run / "metrics.jsonl") if "eval_loss" in m}


def train(plan: str, run: Path, *args: str) -> subprocess.CompletedProcess:
    p = mscale("train", plan, "--local", "4", "--run-dir", str(run), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps of the 4-process plan on real text: two prepared sources blended and shuffled,
    a held-out loss every 3 steps (the data path of docs/data.md under every test here)."""
    tmp = tmp_path_factory.mktemp("straight")
    plan = text_plan(tmp, text_data(tmp_path_factory.mktemp("data")))
    train(plan, tmp / "run", "--steps", "6", "--ckpt-interval", "3")
    return plan, tmp / "run"


def test_stop_and_resume_is_bit_identical(straight, tmp_path):
    """A halt (requested before the start, so it lands on the first step boundary) saves and
    stops; the resumed run ends exactly where the straight one did. Both runs keep --steps 6:
    --steps lays the LR schedule over the steps it names."""
    plan, ref = straight
    run = tmp_path / "run"
    (run / "control" / "halt").mkdir(parents=True)
    p = mscale("train", plan, "--local", "4", "--run-dir", str(run), "--steps", "6")
    assert p.returncode == 1, p.stdout + p.stderr
    assert sorted(losses(run)) == [1] and not (run / "control" / "halt").exists()
    assert "control/halt was made before this attempt started" in p.stdout  # no surprise stop
    train(plan, str(run), "--steps", "6")
    assert losses(run) == losses(ref) and len(losses(ref)) == 6
    assert eval_losses(run) == eval_losses(ref) and sorted(eval_losses(ref)) == [3, 6]
    assert list((ref / "tensorboard" / "attempt-001").glob("events.out.tfevents.*"))
    assert list((run / "tensorboard" / "attempt-002").glob("events.out.tfevents.*"))
    info = [e for e in records(run / "events.jsonl") if e["kind"] == "info"]
    before, resumed = info[0], [e for e in info if "resumed from" in e["message"]]
    assert before["step"] == 0 and "held-out loss before training" in before["message"]
    assert len(resumed) == 1 and resumed[0]["step"] == 1
    p = mscale("ckpt", "ls", str(run), "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["latest"] == "step-000006"
    assert [c["status"] for c in doc["checkpoints"]] == ["committed", "committed"]


def test_kill_9_during_a_write_keeps_the_previous_checkpoint(straight, tmp_path):
    plan, ref = straight
    run = tmp_path / "run"
    proc = subprocess.Popen([MSCALE, "train", plan, "--local", "4", "--run-dir", str(run),
                             "--steps", "6", "--ckpt-interval", "2", "--inject-ckpt-delay",
                             "0.2"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = run / "ckpt"
    deadline = time.monotonic() + 120
    try:
        while not ((ckpt / "latest").exists() and (ckpt / "latest").read_text().strip()
                   == "step-000002" and list((ckpt / "step-000004").glob("rank-*.bin"))):
            assert proc.poll() is None and time.monotonic() < deadline, "never got in flight"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert not (ckpt / "step-000004" / "COMMITTED").exists()
    assert (ckpt / "latest").read_text().strip() == "step-000002"
    assert mscale("ckpt", "verify", str(ckpt / "latest")).returncode == 0
    p = mscale("ckpt", "verify", str(ckpt / "step-000004"), "--json")
    assert p.returncode == 2
    assert {x["file"] for x in json.loads(p.stdout)["problems"]} >= {"COMMITTED"}
    train(plan, str(run), "--steps", "6")  # resumes from step 2 and removes the dead attempt
    got = losses(run)
    assert all(got[s] == losses(ref)[s] for s in range(3, 7))
    info = [e for e in records(run / "events.jsonl") if e["kind"] == "info"][-1]
    assert info["step"] == 2 and "removed step-000004 (never committed)" in info["evidence"]["cleaned"]


def test_a_full_checkpoint_filesystem_stops_the_job_and_loses_nothing(straight, tmp_path):
    """A full disk is not transient: the job stops at the next step boundary (exit 3) with
    ``latest`` on the last good checkpoint, and the same command resumes once there is room."""
    plan, _ = straight
    run = tmp_path / "run"
    ckpt = run / "ckpt"
    args = ("train", plan, "--local", "4", "--run-dir", str(run), "--steps", "3",
            "--ckpt-interval", "1", "--zstd-level", "0")
    # one raw checkpoint of this model is ~3 MB: the first fits, the second cannot. Mounting
    # needs root: skipped without (tests/e2e/test_train_faults.py injects ENOSPC), failed in CI
    with small_tmpfs(ckpt, "4m"):
        p = mscale(*args)
        assert p.returncode == 3, p.stdout + p.stderr
        events = records(run / "events.jsonl")
        ok = [e["step"] for e in events if e["kind"] == "checkpoint"]
        failed = [e for e in events if e["kind"] == "checkpoint_failed"]
        assert ok == [1] and [e["step"] for e in failed] == [2]
        assert "No space left on device" in json.dumps(failed[0]["evidence"])
        assert failed[0]["evidence"]["latest"] == "step-000001"
        stop = [e for e in events if e["kind"] == "stop" and "code" in e.get("evidence", {})]
        assert stop and stop[-1]["evidence"]["code"] == 3
        assert (ckpt / "latest").read_text().strip() == "step-000001"
        assert mscale("ckpt", "verify", str(run)).returncode == 0
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-000001"]
    p = mscale(*args)  # room again: the same command resumes from step 1 and finishes
    assert p.returncode == 0, p.stdout + p.stderr
    starts = [e for e in records(run / "events.jsonl") if e["kind"] == "start"]
    assert len(starts) == 2
    assert (ckpt / "latest").read_text().strip() == "step-000003"


def test_damaged_checkpoints_are_named(straight, tmp_path):
    plan, ref = straight
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    step = run / "ckpt" / "step-000006"
    shard = step / "rank-00002.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x04
    shard.write_bytes(bytes(data))
    p = mscale("ckpt", "verify", str(run / "ckpt" / "latest"), "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == 2 and not doc["ok"]
    assert {x["file"] for x in doc["problems"]} == {"rank-00002.bin"}
    p = mscale("train", plan, "--local", "4", "--run-dir", str(run), "--steps", "8")
    assert p.returncode == 3 and "rank-00002.bin" in p.stdout + p.stderr + _logs(run)
    (step / "rank-00001.bin").unlink()
    p = mscale("ckpt", "verify", str(step), "--quick")
    assert p.returncode == 2 and "rank-00001.bin" in p.stdout and "missing" in p.stdout
    assert mscale("ckpt", "verify", str(run / "ckpt" / "step-000003")).returncode == 0


def _logs(run: Path) -> str:
    return "".join(p.read_text() for p in (run / "logs").glob("rank*.log"))


def test_convert_offline_and_train_from_hf_weights(straight, tmp_path):
    plan, ref = straight
    hf = tmp_path / "hf"
    p = mscale("ckpt", "convert", str(ref), str(hf), "--to-hf", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["format"] == "hf-safetensors"
    assert (hf / "model.safetensors").exists() and json.loads((hf / "config.json").read_text())
    run = tmp_path / "run"
    p = mscale("ckpt", "convert", str(hf), str(run / "ckpt" / "step-000000"), "--plan", plan)
    assert p.returncode == 0, p.stderr
    train(plan, str(run), "--steps", "2")
    first = losses(run)[1][0]
    assert first < losses(ref)[1][0]  # starts from trained weights, not from scratch
    p = mscale("ckpt", "convert", str(hf), str(run / "x"), "--to-hf")
    assert p.returncode == 3 and "Traceback" not in p.stderr
