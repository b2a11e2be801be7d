"""A restart with another global batch (what `mscale recover --allow-batch-change` relaunches):
refused without the flag, and with it the data continues from the samples already consumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.e2e.train_run import mscale, records, small_plan

pytestmark = pytest.mark.e2e

TRAIN = ["--local", "4", "--ckpt-interval", "2", "--timeout", "20"]


def test_batch_change_needs_the_flag_and_continues_the_data(tmp_path):
    plan = Path(small_plan(tmp_path, micro_batch=2))  # tp2 dp2, global batch 16, then 24
    run = tmp_path / "run"
    first = mscale("train", str(plan), *TRAIN, "--steps", "4", "--run-dir", str(run))
    assert first.returncode == 0, first.stdout + first.stderr

    bigger = tmp_path / "plan-24.yaml"
    data = yaml.safe_load(plan.read_text())
    data["training"]["global_batch"] = 24
    bigger.write_text(yaml.safe_dump(data))
    refused = mscale("train", str(bigger), *TRAIN, "--steps", "6", "--run-dir", str(run))
    out = refused.stdout + refused.stderr
    assert refused.returncode == 3 and "Traceback" not in out, out
    assert "training.global_batch" in out and "--allow-batch-change" in out, out

    ok = mscale("train", str(bigger), *TRAIN, "--steps", "6", "--run-dir", str(run),
                "--allow-batch-change")
    out = ok.stdout + ok.stderr
    assert ok.returncode == 0, out
    assert "training.global_batch" in out, out  # the console names the change
    state = json.loads((run / "ckpt" / "step-000006" / "manifest.json").read_text())["state"]
    assert state["samples"] == 4 * 16 + 2 * 24
    steps = [r["step"] for r in records(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    history = sorted(p.name for p in (run / "plans").iterdir())
    assert history == ["plan-0001.yaml", "plan-0002.yaml"]
    # the change is attempt 2's (after its start), and names the file that keeps the new plan
    events = [(e["kind"], e["message"]) for e in records(run / "events.jsonl")]
    starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
    changed = [i for i, (_, message) in enumerate(events) if message == "plan changed on restart"]
    assert len(starts) == 2 and len(changed) == 1 and changed[0] > starts[1], events
    evidence = records(run / "events.jsonl")[changed[0]]["evidence"]
    assert evidence["history"] == f"{run}/plans/plan-0002.yaml", evidence
