"""`mscale recover RUN --execute` under a real SLURM (conftest.slurm: node[1-4], 2 tasks each).

An sbatch job trains the cpu-tiny plan (8 ranks, tp2·pp2·dp2) on node[1-4] and node3 goes bad:
both of its ranks (4 and 5) are killed mid-step by the ``--inject-crash`` hook, and SLURM drains
the node (what a node health check does after such a failure; the test does it with scontrol and
resumes the node afterwards). recover diagnoses the lost connection with node3's ranks as the
suspects, re-checks node3 (SLURM's word: drained), keeps it out, re-plans for the three nodes
left, and submits ``sbatch --exclude=node3``; the new job must resume from the newest checkpoint
committed before the fault and train to the end on 6 ranks. Skips where SLURM cannot start,
except in CI (conftest).
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
    """The ``stop`` event of ``attempt`` (rank 0 writes one when its job ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = records(run / "events.jsonl")
        starts = [i for i, e in enumerate(evs) if e["kind"] == "start"]
        if len(starts) >= attempt:
            stop = [e for e in evs[starts[attempt - 1]:]
                    if e["kind"] == "stop" and e["source"] == "train"]
            if stop:
                return stop[0]
        time.sleep(0.5)
    raise AssertionError(f"attempt {attempt} did not stop within {timeout} s: "
                         f"{(run / 'events.jsonl').read_text()}")


def node3(slurm, state: str, reason: str = "") -> None:
    extra = [f"reason={reason}"] if reason else []
    slurm.run("scontrol", "update", "nodename=node3", f"state={state}", *extra)


def test_bad_node_excluded_replanned_and_resumed(slurm, tmp_path):
    run = tmp_path / "run"
    mscale = os.path.join(os.path.dirname(slurm.python), "mscale")
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"srun --kill-on-bad-exit=1 {mscale} train {PLAN} --run-dir {run} --steps {STEPS} "
        "--ckpt-interval 3 --timeout 20 --inject-crash 4:6 --inject-crash 5:6\n")
    env = slurm.env(MASTER_ADDR="127.0.0.1")
    first = subprocess.run(["sbatch", "--wait", "-J", JOB_NAME, "-N", "4", "-n", "8",
                            "--ntasks-per-node=2", "-o", str(tmp_path / "job1.out"),
                            str(script)], env=env, text=True, capture_output=True, timeout=300)
    assert first.returncode != 0, first.stdout + first.stderr  # node3's ranks were killed
    committed = [e["step"] for e in records(run / "events.jsonl") if e["kind"] == "checkpoint"]
    assert committed and max(committed) < 6, committed

    node3(slurm, "drain", "mscale-e2e: node3 lost its ranks")
    try:
        rec = subprocess.run([mscale, "recover", str(run), "--execute", "--json"], env=env,
                             text=True, capture_output=True, timeout=180)
        assert rec.returncode == 1, rec.stdout + rec.stderr  # degraded: fewer nodes
        plan = json.loads(rec.stdout)
        stop = wait_for_stop(run, 2)
    finally:
        node3(slurm, "resume")
    assert plan["diagnosis"]["suspect_nodes"] == ["node3"], plan["diagnosis"]
    assert plan["exclusions"]["nodes"] == ["node3"], plan["exclusions"]
    assert plan["command"][0] == "sbatch" and any(
        a.startswith("--exclude=") and expand_hostlist(a.split("=", 1)[1]) == ["node3"]
        for a in plan["command"]), plan["command"]
    replan = plan["replan"]
    assert replan["nodes"] == ["node1", "node2", "node4"] and replan["world"] == 6, replan
    assert replan["global_batch"] == 16 and not replan["batch_changed"]
    assert plan["checkpoint"]["step"] == max(committed)

    assert stop["evidence"]["code"] == 0, stop
    evs = records(run / "events.jsonl")
    start = [e for e in evs if e["kind"] == "start"][1]
    launch = start["evidence"]["launch"]
    assert start["evidence"]["launcher"] == "slurm" and launch["nodes"] == replan["nodes"]
    assert launch["slurm"]["nnodes"] == 3 and launch["plan"] == replan["plan_path"]
    resumed = [e for e in evs if e["message"].startswith("resumed from")]
    assert resumed[-1]["evidence"]["path"].endswith(f"ckpt/step-{max(committed):06d}")
    metrics = records(run / "metrics.jsonl")
    assert metrics[-1]["step"] == STEPS and len(metrics[-1]["step_time"]) == 6
