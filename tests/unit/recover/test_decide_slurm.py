"""plan_recovery under SLURM with the real exclusion, re-plan and relaunch stages (the diagnosis
and the checkpoint faked, scontrol answered): SLURM's node names against the plan's, the job's
own exclusions against quarantine's releases, and a suspect the job already keeps out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mscale.config.records import Quarantine, QuarantineEntry
from mscale.recover import relaunch, stages
from mscale.recover.decide import RecoverOptions, apply_plan, plan_recovery
from mscale.recover.decision import CheckpointChoice, Diagnosis
from mscale.recover.recheck import Rechecker
from mscale.recover.report import render

from tests.conftest import PLANS
from tests.unit.recover.decide_fakes import srun_command

SLURM_NODES = ["node1", "node2", "node3", "node4"]
T_FAIL = 1000.0


@dataclass
class Job:
    path: Path
    scontrol: dict[str, str]
    """What `scontrol show job` answers, a test may change it."""
    diagnosis: Diagnosis


@pytest.fixture
def job(tmp_path, monkeypatch) -> Job:
    """A run of cpu-tiny (8 ranks) whose plan names gpu[01-04]; SLURM job 7 ran its attempt on
    node[1-4] and rank 5 on node3 died of a GPU fault."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    plan = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    plan["cluster"]["hostlist"] = "gpu[01-04]"
    (run / "plan.yaml").write_text(yaml.safe_dump(plan))
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run)]
    events = [
        {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
            "launcher": "slurm", "attempt": 1, "launch": {
                "argv": argv, "cwd": str(tmp_path), "plan": str(run / "plan.yaml"), "local": 0,
                "nodes": SLURM_NODES, "slurm": {"job_id": "7", "job_name": "j",
                                                "nodelist": "node[1-4]", "nnodes": 4}}}},
        {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5], "nodes": ["node3"]}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    scontrol = {"JobId": "7", "JobState": "FAILED", "BatchFlag": "1", "Partition": "debug",
                "Command": "/nonexistent/job.sh", "ExcNodeList": "(null)"}
    monkeypatch.setattr(relaunch, "run_quiet", lambda argv: (0, " ".join(
        f"{k}={v}" for k, v in scontrol.items())))
    diagnosis = Diagnosis(cls="gpu", symptom="crash", summary="rank 5 on node3: Xid 79",
                          suspect_ranks=[5], suspect_nodes=["node3"], attempt=1)
    monkeypatch.setattr(stages, "diagnose", lambda run_dir: diagnosis)
    monkeypatch.setattr(stages, "choose_checkpoint", lambda r, d, verify="quick":
                        CheckpointChoice(path=None, step=None, reason="none yet"))
    return Job(run, scontrol, diagnosis)


def quarantine(run: Path, *entries, reason: str = "slow GPU"):
    q = Quarantine(entries=[QuarantineEntry(node=n, reason=reason, since=since,
                                            expires=expires) for n, since, expires in entries])
    (run / "quarantine.json").write_text(q.model_dump_json())


def test_slurms_names_are_subtracted_when_the_plan_names_its_nodes_otherwise(job):
    """node3, SLURM's name for the plan's gpu03, is kept out: the re-plan must count 3 nodes
    (it subtracted by the plan's names, found none excluded, and asked SLURM for 4 nodes
    without node3: 'relaunch as before' on a 4-node partition that sbatch refuses)."""
    plan = plan_recovery(str(job.path), RecoverOptions(recheck=False))
    assert plan.exclusions.nodes == ["node3"] and plan.verdict == "degraded"
    assert plan.replan is not None and plan.replan.world == 6
    assert plan.replan.nodes == ["node1", "node2", "node4"]
    assert "--nodes=3" in plan.command and "--exclude=node3" in plan.command


def test_a_quarantine_entry_by_the_plans_name_keeps_out_slurms_node(job):
    """watch names a node by the plan (gpu03): the relaunch must exclude it by SLURM's name
    (sbatch refuses an --exclude of a node it does not know), and the re-plan count it."""
    job.diagnosis.cls, job.diagnosis.suspect_nodes = "software", []
    quarantine(job.path, ("gpu03", 0.0, None), reason="watch: slow GPU")
    plan = plan_recovery(str(job.path), RecoverOptions(recheck=False))
    assert plan.exclusions.nodes == ["node3"]
    assert "entered as gpu03, the plan's name for node3" in plan.exclusions.reasons["node3"]
    assert "--exclude=node3" in plan.command and "--nodes=3" in plan.command


def test_an_entry_made_by_hand_names_the_node_as_slurm_knows_it(job):
    """A plan of node[1-4] run on node[5-8], and node2 (a real node outside the allocation)
    quarantined by hand: it was read as the plan's name for node6, so node6, healthy, was kept
    out (the job shrunk to 3 nodes) and node2 was left out of a resubmission's --exclude."""
    plan = yaml.safe_load((job.path / "plan.yaml").read_text())
    plan["cluster"]["hostlist"] = "node[1-4]"
    (job.path / "plan.yaml").write_text(yaml.safe_dump(plan))
    events = [json.loads(x) for x in (job.path / "events.jsonl").read_text().splitlines()]
    launch = events[0]["evidence"]["launch"]
    launch["nodes"], launch["slurm"]["nodelist"] = ["node5", "node6", "node7", "node8"], \
        "node[5-8]"
    (job.path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    job.diagnosis.cls, job.diagnosis.suspect_nodes = "software", []
    quarantine(job.path, ("node2", 0.0, None))
    plan = plan_recovery(str(job.path), RecoverOptions(recheck=False))
    assert plan.exclusions.nodes == ["node2"] and plan.replan is None
    assert "--exclude=node2" in plan.command and "node6" not in " ".join(plan.command)
    # and it is said to be outside the run (a plan name is not one of the run's nodes)
    assert "not one of the run's nodes" in plan.exclusions.reasons["node2"]


def test_a_node_let_back_then_excluded_by_hand_stays_out(job):
    """node3's quarantine expired and recovery 1 let it back (dropped it from the job's -x);
    the operator then put it in the job's -x again: that latest word stands. It used to be let
    back again on every recovery (an expired entry, or an old decision's quarantine reason)."""
    job.diagnosis.cls, job.diagnosis.suspect_nodes = "software", []
    quarantine(job.path, ("node3", 0.0, 10.0))
    opts = RecoverOptions(recheck=False, command=srun_command(job.path, "node3"))
    first = plan_recovery(str(job.path), opts)
    assert first.exclusions.released == ["node3"] and "node3" not in " ".join(first.command)
    assert ("let back by this recovery: node3 (kept out by the job for quarantine, which no "
            "longer holds it)") in render(first, executed=False, decision=None)
    apply_plan(first)
    doc = json.loads((job.path / "recover/decision-0001.json").read_text())
    assert doc["exclusions"]["released"] == ["node3"] and doc["time"] > 10.0
    again = plan_recovery(str(job.path), opts)  # the operator's -x node3 after that release
    assert again.exclusions.released == [] and "--exclude=node3" in again.command
    assert again.exclusions.carried == {"node3": relaunch.BY_COMMAND}
    # quarantined anew since the release (dated back to 100 here), and expired: let back again
    (job.path / "recover/decision-0001.json").write_text(json.dumps({**doc, "time": 100.0}))
    quarantine(job.path, ("node3", 0.0, 10.0), ("node3", 200.0, 300.0))
    assert plan_recovery(str(job.path), opts).exclusions.released == ["node3"]


def test_a_suspect_the_job_already_keeps_out_is_not_re_checked(job, monkeypatch):
    """The operator took node3 off the job after the failure (scontrol update ExcNodeList):
    a re-check could not bring it back, so none is run, and one line says why."""
    asked = []
    monkeypatch.setattr(Rechecker, "__call__", lambda self, nodes: asked.append(nodes) or {})
    job.scontrol["ExcNodeList"] = "node3"
    plan = plan_recovery(str(job.path), RecoverOptions())
    assert asked == [] and plan.exclusions.nodes == []
    assert list(plan.exclusions.carried) == ["node3"] and plan.replan.world == 6
    line = ("suspect node3 not re-checked: already kept out of the job's allocation before "
            "this recovery (scontrol's ExcNodeList)")
    assert plan.exclusions.notes == [line] and line in plan.reasons
    assert "--exclude=node3" in plan.command
