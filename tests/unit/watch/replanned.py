"""A run re-planned by recover, shared by the watch tests of its layouts and its report: attempt 1
on 8 ranks (tp 2 × pp 2 × dp 2 on node1..node4) whose rank 5 (node3) is slow from step 10,
then attempt 2 on 4 ranks (dp 1 on node1, node2) after node3 was left out, to a clean finish."""

from __future__ import annotations

import json
import shutil
import time

from mscale.config.base import load_model
from mscale.config.plan import Plan
from mscale.config.records import Event
from mscale.runs.history import plan_change_of, write_plan
from mscale.runs.rundir import RunDir
from mscale.watch.sim import Injection, simulate

from tests.conftest import PLANS

SLOW_RANK, SLOW_NODE = 5, "node3"


def _start(rd: RunDir, attempt: int, at: float, dp: int, nodes: list[str]) -> None:
    """train's start event: the fields watch reads (session.py: the layout and launch)."""
    layout = {"tp": 2, "pp": 2, "dp": dp, "vpp": 1, "micro_batch": 2, "stage_layers": None}
    rd.append_record(rd.events, Event(
        source="train", kind="start", time=at, message="training cpu-tiny",
        evidence={"run_id": f"local-{attempt}", "attempt": attempt, "layout": layout,
                  "launch": {"nodes": nodes, "local": 2 * len(nodes)}}))


def _records(rd: RunDir, recs: list[dict], at: float) -> None:
    with open(rd.metrics, "a") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps({**r, "time": at + i}) + "\n")


def replanned_run(root: str, nodes: tuple[str, ...] = ("node1", "node2", "node3", "node4")
                  ) -> RunDir:
    """``nodes``: the names the start events record (SLURM's may not be the plan's)."""
    rd = RunDir(root)
    rd.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", rd.plan)
    old = load_model(Plan, rd.plan)
    t0 = time.time() - 3600
    _start(rd, 1, t0, 2, list(nodes))
    slow = simulate(8, tp=2, pp=2, ranks_per_node=2, steps=40, seed=1,
                    inject=[Injection("slow_device", 10, SLOW_RANK, magnitude=1.5)])
    _records(rd, slow, t0 + 10)
    new = old.model_copy(update={
        "cluster": old.cluster.model_copy(update={"nodes": 2, "hostlist": "node[1-2]"}),
        "layout": old.layout.model_copy(update={"dp": 1})})
    write_plan(rd, new, plan_change_of(rd, new))  # train's claim of recover's plan
    _start(rd, 2, t0 + 600, 1, list(nodes[:2]))
    healthy = simulate(4, tp=2, pp=2, ranks_per_node=2, steps=60, seed=2)
    _records(rd, [r for r in healthy if r["step"] >= 31], t0 + 610)
    rd.append_record(rd.events, Event(source="train", kind="stop", time=t0 + 700, step=60,
                                      message="training process exited with code 0",
                                      evidence={"code": 0, "run_id": "local-2", "attempt": 2}))
    return rd
