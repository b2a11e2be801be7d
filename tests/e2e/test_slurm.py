"""mscale's launch path under a real SLURM: four emulated nodes on one machine (conftest.slurm).

What train relies on is checked against srun and sbatch themselves: SLURM_* variables become the
right rank, node and plan coordinate on the node the plan names; --exclude reshapes the
allocation; a batch job's compressed SLURM_JOB_NODELIST expands to the master address.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import astuple

import pytest

from mscale.config.plan import load_plan
from mscale.topology.env import slurm_master_port
from mscale.topology.placement import placement_for
from tests.conftest import PLANS
from tests.e2e.conftest import JOB_NAME

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

PLAN = PLANS / "cpu-tiny.yaml"
NODES = ["node1", "node2", "node3", "node4"]


def check_probe(lines: list[str]) -> list[dict]:
    """Eight probe records that match placement_for(cpu-tiny) rank by rank."""
    place = placement_for(load_plan(str(PLAN)))
    recs = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in recs] == list(range(8))
    assert Counter(r["hostname"] for r in recs) == {n: 2 for n in NODES}
    for r in recs:
        rank = r["rank"]
        assert (r["launcher"], r["world_size"]) == ("slurm", 8)
        assert (r["dp"], r["pp"], r["tp"]) == astuple(place.coord(rank))
        assert r["node_rank"] == place.node(rank) == NODES.index(r["hostname"])
        assert r["local_rank"] == place.local_rank(rank)
        assert r["plan_node"] == r["hostname"] and r["node_match"], r
    return recs


def test_srun_places_ranks_as_the_plan_does(slurm):
    out = slurm.run("srun", "-J", JOB_NAME, "-N", "4", "-n", "8", "--ntasks-per-node=2",
                    slurm.python, "-m", "mscale.topology.probe", str(PLAN),
                    MASTER_ADDR="127.0.0.1")
    recs = check_probe(out.splitlines())
    assert {r["master_addr"] for r in recs} == {"127.0.0.1"}
    assert len({r["master_port"] for r in recs}) == 1


def test_srun_exclude_avoids_the_node(slurm):
    out = slurm.run("srun", "-J", JOB_NAME, "-N", "3", "--exclude=node2",
                    "sh", "-c", 'echo "$SLURMD_NODENAME $SLURM_JOB_NODELIST"')
    rows = sorted(line.split() for line in out.splitlines())
    assert rows == [["node1", "node[1,3-4]"], ["node3", "node[1,3-4]"], ["node4", "node[1,3-4]"]]


def test_sbatch_batch_path(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n"
                      'echo "NODELIST=$SLURM_JOB_NODELIST"\n'
                      f"srun {slurm.python} -m mscale.topology.probe {PLAN}\n")
    out_file = tmp_path / "job.out"
    job_id = slurm.run("sbatch", "--wait", "--parsable", "-J", JOB_NAME, "-N", "4", "-n", "8",
                       "--ntasks-per-node=2", "-o", str(out_file), str(script)).strip()
    lines = out_file.read_text().splitlines()
    assert lines[0] == "NODELIST=node[1-4]"  # compressed syntax, as on a real cluster
    recs = check_probe(lines[1:])
    # Nothing set MASTER_ADDR/PORT: env.py takes the first node of the list and a job-id port.
    assert {(r["master_addr"], r["master_port"]) for r in recs} == {
        ("node1", slurm_master_port(job_id.split(";")[0]))}


def test_srun_mscale_train_runs_the_plan(slurm, tmp_path):
    """The real engine under srun: 8 ranks on 4 nodes, tp2 pp2 dp2, as the plan lays them out."""
    import os

    run = tmp_path / "run"
    mscale = os.path.join(os.path.dirname(slurm.python), "mscale")
    slurm.run("srun", "-J", JOB_NAME, "-N", "4", "-n", "8", "--ntasks-per-node=2", mscale,
              "train", str(PLAN), "--steps", "3", "--run-dir", str(run), "--timeout", "60",
              timeout=240, MASTER_ADDR="127.0.0.1")
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    start = events[0]
    assert start["kind"] == "start" and start["evidence"]["launcher"] == "slurm"
    assert start["evidence"]["layout"]["tp"] == 2 and start["evidence"]["layout"]["pp"] == 2
    assert events[-1]["kind"] == "stop" and events[-1]["evidence"]["code"] == 0
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and len(metrics[0]["step_time"]) == 8
