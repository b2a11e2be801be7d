"""A silently degraded link, end to end: one rank's socket writes are paced from outside mscale
(tests/faults/slowlink.c, an LD_PRELOAD shim: no flag of ``train``), starting after a clean
stretch of steps. Watch, live beside the job, must name that rank's node as ``slow_link`` within
a few steps of the onset, have the job commit a checkpoint, and only then quarantine the node;
``--once`` afterwards agrees. The job itself finishes: a slow link crashes nothing.

The first case paces every socket write of the rank (``scope="all"``), its node's TP traffic
included; the second a node's NIC as it degrades on a cluster: only what leaves the node."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import yaml

from tests.conftest import REPO
from tests.e2e.train_run import MSCALE, mscale, records, small_plan
from tests.faults import slowlink

pytestmark = [pytest.mark.e2e, pytest.mark.timing]

SLOW_RANK, SLOW_NODE = 3, "node2"  # tp2 x dp2 on node[1-2]: ranks 2 and 3 are node2
ONSET_STEP = 9  # after the 5 warm-up steps and a few clean ones
BPS = 2_000_000


def test_a_paced_rank_is_named_as_its_nodes_slow_link_checkpointed_then_quarantined(tmp_path):
    shim = slowlink.build_for_test(tmp_path / "shim")
    run, flag = tmp_path / "run", tmp_path / "onset"
    env = {**os.environ, **slowlink.env(shim, f"RANK={SLOW_RANK}", BPS, flag, scope="all")}
    job = subprocess.Popen([MSCALE, "train", small_plan(tmp_path), "--local", "4", "--steps",
                            "24", "--ckpt-interval", "1000", "--run-dir", str(run)],
                           cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    with slowlink.onset_after_step(run, ONSET_STEP - 1, flag):
        deadline = time.monotonic() + 120
        while not run.is_dir():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.1)
        live = mscale("watch", str(run), "--interval", "0.5", "--jsonl", timeout=300)
        out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert flag.exists()
    found = [json.loads(line) for line in live.stdout.splitlines()]
    links = [f for f in found if f["kind"] == "straggler" and f["cause"] == "slow_link"]
    assert links and all(f["nodes"] == [SLOW_NODE] for f in links), found
    assert links[0]["evidence"]["detected_at"] <= ONSET_STEP + 10, links[0]
    assert not [f for f in found if f["kind"] == "straggler" and f["nodes"]
                and f["nodes"] != [SLOW_NODE]], found

    events = records(run / "events.jsonl")
    at = {name: next(i for i, e in enumerate(events) if test(e)) for name, test in (
        ("finding", lambda e: e["source"] == "watch" and e["kind"] == "straggler"),
        ("ckpt", lambda e: e["kind"] == "checkpoint" and e["evidence"]["reason"] == "request"),
        ("quarantine", lambda e: e["source"] == "watch"
         and e["evidence"].get("action") == "quarantine"))}
    assert at["finding"] < at["ckpt"] < at["quarantine"], events
    [entry] = json.loads((run / "quarantine.json").read_text())["entries"]
    assert entry["node"] == SLOW_NODE and entry["evidence"]["checkpoint_confirmed"] is True

    once = mscale("watch", str(run), "--once", "--json")
    doc = json.loads(once.stdout)
    assert any(f["cause"] == "slow_link" and f["nodes"] == [SLOW_NODE]
               for f in doc["findings"]), doc["findings"]


def test_a_nic_that_slows_only_cross_node_traffic_is_named_by_its_dp_group_and_pipeline_pair(
        tmp_path):
    """tp1 x pp2 x dp2 on four one-rank nodes, node3 (rank 2: stage 1, replica 0) sending
    what leaves it at 1 MB/s from the start. No group is slower than its stage's peers (a DP
    group holds one rank a stage-node); its DP group is slower than stage 0's and its pipeline
    pair than replica 1's, and node3 is the one node in both. Before, watch named nobody."""
    plan = yaml.safe_load(open(small_plan(tmp_path, tp=1, pp=2, micro_batch=2,
                                          sequence_parallel=False)))
    plan["cluster"].update(hostlist="node[1-4]", gpus_per_node=1)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    shim = slowlink.build_for_test(tmp_path / "shim")
    env = {**os.environ, **slowlink.env(shim, "MSCALE_NODE=node3", 1_000_000)}
    run = tmp_path / "run"
    job = subprocess.run([MSCALE, "train", str(tmp_path / "plan.yaml"), "--local", "4",
                          "--steps", "16", "--ckpt-interval", "1000", "--run-dir", str(run)],
                         cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    doc = json.loads(mscale("watch", str(run), "--once", "--json").stdout)
    named = [f for f in doc["findings"] if f["kind"] == "straggler" and f["nodes"]]
    assert named and all(f["cause"] == "slow_link" and f["nodes"] == ["node3"]
                         for f in named), doc["findings"]
    [entry] = json.loads((run / "quarantine.json").read_text())["entries"]
    assert entry["node"] == "node3"
