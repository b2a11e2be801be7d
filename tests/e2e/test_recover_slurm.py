"""`mscale recover RUN --execute` under a real SLURM (conftest.slurm: node[1-4], 2 tasks each).

An sbatch job trains the cpu-tiny plan (8 ranks, tp2·pp2·dp2) on node[1-4]; node3 goes bad: both
of its ranks (4 and 5) are killed mid-step by the ``--inject-crash`` hook, and watch's verdict on
the node is in ``quarantine.json`` (as `mscale watch` leaves it after a hardware straggler).
recover must relaunch with ``--exclude=node3``, re-planned for the remaining nodes, and the new
job must resume from the newest checkpoint committed before the fault and train to the end.
Skips where SLURM cannot start, except in CI (conftest).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from mscale.hostlist import expand_hostlist
from tests.conftest import PLANS
from tests.e2e.conftest import JOB_NAME
from tests.e2e.train_run import records

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

PLAN = PLANS / "cpu-tiny.yaml"
STEPS = 10


def wait_for_stop(run: Path, attempt: int, timeout: float = 240) -> dict:
    """The ``stop`` event of ``attempt`` (every rank's job ends with one from rank 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = records(run / "events.jsonl") if (run / "events.jsonl").exists() else []
        starts = [i for i, e in enumerate(evs) if e["kind"] == "start"]
        if len(starts) >= attempt:
            after = evs[starts[attempt - 1]:]
            stop = [e for e in after if e["kind"] == "stop" and e["source"] == "train"]
            if stop:
                return stop[0]
        time.sleep(0.5)
    raise AssertionError(f"attempt {attempt} did not stop within {timeout} s: "
                         + ((run / "events.jsonl").read_text() if (run / "events.jsonl").exists()
                            else "no events"))


def test_bad_node_excluded_replanned_and_resumed(slurm, tmp_path):
    run = tmp_path / "run"
    mscale = os.path.join(os.path.dirname(slurm.python), "mscale")
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun --kill-on-bad-exit=1 {mscale} train {PLAN} --run-dir {run} --steps {STEPS} "
        "--ckpt-interval 3 --timeout 20 --inject-crash 4:6 --inject-crash 5:6\n")
    p = subprocess.run(
        ["sbatch", "--wait", "--parsable", "-J", JOB_NAME, "-N", "4", "-n", "8",
         "--ntasks-per-node=2", "-o", str(tmp_path / "job1.out"), str(script)],
        env=slurm.env(MASTER_ADDR="127.0.0.1"), text=True, capture_output=True, timeout=300)
    assert p.returncode != 0, "the first job should have failed"  # its ranks were killed
    evs = records(run / "events.jsonl")
    committed = [e["step"] for e in evs if e["kind"] == "checkpoint"]
    assert committed and max(committed) < 6, evs
    (run / "quarantine.json").write_text(json.dumps({"entries": [{
        "node": "node3", "reason": "watch: straggler (slow device) on node3",
        "since": time.time(), "expires": time.time() + 3600}]}))

    rec = subprocess.run(
        [mscale, "recover", str(run), "--execute", "--json", "--no-recheck"],
        env=slurm.env(MASTER_ADDR="127.0.0.1"), text=True, capture_output=True, timeout=120)
    assert rec.returncode in (0, 1), rec.stdout + rec.stderr  # 1: degraded (fewer nodes)
    plan = json.loads(rec.stdout)
    assert plan["exclusions"]["nodes"] == ["node3"], plan
    assert any(a.startswith("--exclude=") and "node3" in expand_hostlist(a.split("=", 1)[1])
               for a in plan["command"]), plan["command"]
    replan = plan["replan"]
    assert replan and "node3" not in replan["nodes"] and replan["world"] < 8, replan
    assert plan["checkpoint"]["step"] == max(committed)

    stop = wait_for_stop(run, 2)
    assert stop["evidence"]["code"] == 0, stop
    evs = records(run / "events.jsonl")
    start = [e for e in evs if e["kind"] == "start"][1]
    assert start["evidence"]["launcher"] == "slurm"
    launch = start["evidence"].get("launch") or {}
    nodes = launch.get("nodes") or []
    assert nodes and "node3" not in nodes, launch
    resumed = [e for e in evs if e["message"].startswith("resumed from")]
    assert resumed[-1]["evidence"]["path"].endswith(f"ckpt/step-{max(committed):06d}")
    steps = [r["step"] for r in records(run / "metrics.jsonl")]
    assert steps[-1] == STEPS and len(records(run / "metrics.jsonl")[-1]["step_time"]) == \
        replan["world"]
