"""`mscale train` as users run it: the real binary, several gloo processes, the run directory.

These are the slowest tests of the suite (each launch imports torch in every process), so each
one checks several things about one run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import yaml

from mscale.config import load_plan
from mscale.planner.flops import model_flops
from tests.conftest import PLANS, REPO
from tests.e2e.train_run import MSCALE, mscale, records, small_plan

pytestmark = pytest.mark.e2e
def test_embedded_demo_runs_3d_and_leaves_a_run_directory(tmp_path):
    run = tmp_path / "run"
    p = mscale("train", "--local", "8", "--steps", "4", "--run-dir", str(run),
               "--trace-every", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = records(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # timelines of steps 2 and 4: DP replica 0's pipeline, one track per rank, every
    # micro-batch's forward and backward on each (4 micro-batches: global 16, dp 2, micro 2)
    assert sorted(os.listdir(run / "trace")) == ["step-000002.json", "step-000004.json"]
    doc = json.loads((run / "trace" / "step-000004.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert doc["otherData"]["ranks"] == [0, 1, 4, 5]
    for rank in (0, 1, 4, 5):
        names = {e["name"] for e in spans if e["tid"] == rank}
        assert {f"{kind} mb{m}" for kind in ("forward", "backward") for m in range(4)} <= names
    plan = load_plan(str(run / "plan.yaml"))
    flops = model_flops(plan.model, plan.training.global_batch)
    for m in metrics:
        assert len(m["step_time"]) == len(m["compute_time"]) == len(m["comm_wait"]) == 8
        # a synchronous step lasts as long as its slowest rank: throughput and MFU follow from it
        assert m["tokens"] == 16 * 64
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / max(m["step_time"]), rel=1e-9)
        peak = plan.cluster.gpu.peak_tflops * 1e12 * 8
        assert m["mfu"] == pytest.approx(flops / max(m["step_time"]) / peak, rel=1e-9)
        for r in range(8):  # every rank's regions add up to no more than its step
            parts = m["compute_time"][r] + m["comm_wait"][r] + m["data_time"][r]
            assert parts + (m["bubble_time"] or [0] * 8)[r] <= m["step_time"][r] * (1 + 1e-6)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    kinds = [e["kind"] for e in records(run / "events.jsonl")]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    # plan.yaml is written resolved, with its placement
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (2, 2, 2)
    assert plan.placement is not None
    # logs, start-up phase markers and process ids only: no rank left an error file
    assert sorted(os.listdir(run / "logs")) == sorted(
        f"rank{r}.{kind}" for r in range(8) for kind in ("log", "startup", "pid"))


def test_nan_stops_every_rank_before_the_update(tmp_path):
    """tp 2 · pp 2: rank 0, which prints the stop, holds no loss (the last stage does)."""
    run = tmp_path / "run"
    p = mscale("train", small_plan(tmp_path, pp=2, dp=1), "--local", "4", "--steps", "5",
               "--inject-nan", "2", "--run-dir", str(run))
    assert p.returncode == 2, p.stdout + p.stderr
    assert [m["step"] for m in records(run / "metrics.jsonl")] == [1]
    nan = [e for e in records(run / "events.jsonl") if e["kind"] == "nan"]
    assert len(nan) == 1 and nan[0]["step"] == 2 and nan[0]["severity"] == "critical"
    loss = float(nan[0]["evidence"]["loss"])  # a number (NaN included), never "None"
    assert f"non-finite gradient norm, the optimizer step was not taken; loss {loss}" in p.stdout


@pytest.mark.timing
def test_straggler_shows_highest_compute_lowest_wait(tmp_path):
    run = tmp_path / "run"
    p = mscale("train", small_plan(tmp_path, zero_stage=0), "--local", "4", "--steps", "4",
               "--inject-delay", "3:0.4", "--run-dir", str(run))
    assert p.returncode == 0, p.stdout + p.stderr
    last = records(run / "metrics.jsonl")[-1]
    compute, wait = last["compute_time"], last["comm_wait"]
    assert max(range(4), key=compute.__getitem__) == 3
    # its TP peer (rank 2) waits for it inside every TP collective; the other replica waits in
    # the DP reduction: the slow rank is the one that waits least
    assert min(range(4), key=wait.__getitem__) == 3


def test_sigterm_halts_cleanly_at_a_step_boundary(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([MSCALE, "train", small_plan(tmp_path), "--local", "4", "--steps",
                             "500", "--run-dir", str(run)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    events = records(run / "events.jsonl")
    assert any(e["kind"] == "signal" for e in events), events
    assert events[-1]["kind"] == "stop"
    assert len(records(metrics)) < 500


def test_bad_input_exits_3_without_traceback(tmp_path):
    p = mscale("train", str(PLANS / "cpu-tiny.yaml"), "--local", "4", "--run-dir", str(tmp_path))
    assert p.returncode == 3 and "Traceback" not in p.stderr
    assert "--local 4" in p.stderr and "layout" in p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((PLANS / "cpu-tiny.yaml").read_text().replace("tp: 2", "tp: 3"))
    p = mscale("train", str(bad), "--local", "8", "--run-dir", str(tmp_path))
    assert p.returncode == 3 and "layout.tp" in p.stderr and "Traceback" not in p.stderr


def test_json_summary_from_rank_0_under_a_launcher_environment(tmp_path):
    """srun/torchrun path (no --local): stdout is one JSON document, the console lines stderr."""
    data = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    data["cluster"].update({"hostlist": "node1", "gpus_per_node": 1})
    data["layout"].update({"tp": 1, "pp": 1, "dp": 1})
    plan = tmp_path / "one.yaml"
    plan.write_text(yaml.safe_dump(data))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    p = subprocess.run([MSCALE, "train", str(plan), "--run-dir", str(tmp_path / "run"), "--steps",
                        "2", "--json"], cwd=REPO, env=env, text=True, capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["code"] == 0 and doc["last_step"] == 2 and doc["attempt"] == 1
    assert doc["last_checkpoint"].endswith("step-000002")
    assert "done: steps 1-2" in p.stderr and "step 2/2" in p.stderr
