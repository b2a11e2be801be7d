"""plan_recovery with the stages' own re-plan over a faked diagnosis: the nodes the job itself
already keeps out (its srun -x, SLURM's ExcNodeList, asked of scontrol once) are counted by the
re-plan and reported apart from this recovery's exclusions; one that costs the relaunch no node
changes nothing, and too few nodes left is refused naming them."""

from __future__ import annotations

import pytest

from mscale.recover import stages
from mscale.recover.decide import RecoverOptions, plan_recovery
from mscale.recover.decision import Exclusions

from tests.unit.recover.decide_fakes import (NODES, T_FAIL, fakes, run,  # noqa: F401 - fixtures
                                             srun_command, write_events)


@pytest.fixture
def real_replan(fakes, monkeypatch):
    """The stages' own re-plan over the faked diagnosis: what it counts is the point."""
    from mscale.recover import replan

    monkeypatch.setattr(stages, "replan", replan.replan)
    fakes.diagnosis.cls, fakes.diagnosis.suspect_nodes = "software", []
    return fakes


def test_a_node_the_jobs_own_srun_keeps_out_is_not_counted_by_the_re_plan(run, real_replan):
    """The attempt ran on node[1-4]; the command now keeps node4 out: re-planned for the nodes
    left, the relaunch asks for no more nodes than srun may give it (it asked for 4 of 3)."""
    from mscale.recover.report import render

    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node4")))
    assert plan.exclusions.nodes == [] and list(plan.exclusions.carried) == ["node4"]
    assert plan.replan is not None and "node4" not in plan.replan.nodes
    assert f"--nodes={len(plan.replan.nodes)}" in plan.command
    assert "--exclude=node4" in plan.command and plan.verdict == "degraded"
    text = render(plan, executed=False, decision=None)
    assert "exclusions: none by this recovery\n" in text
    assert ("  node4: kept out by the job's own command (its -x/--exclude) before this "
            "recovery\n") in text
    assert any(r.startswith("1 node(s) kept out: node4 (node4: kept out by the job's own")
               for r in plan.reasons)


def test_a_jobs_exclusion_that_costs_the_relaunch_no_node_changes_nothing(run, real_replan):
    """node9: not among the attempt's nodes (nor the plan's); node4: its quarantine expired,
    so the relaunch lets it back. Either way the job relaunches as it was."""
    from mscale.config.records import Quarantine, QuarantineEntry

    q = Quarantine(entries=[QuarantineEntry(node="node4", reason="hot", expires=1.0)])
    (run / "quarantine.json").write_text(q.model_dump_json())
    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node[4,9]")))
    assert plan.exclusions.carried == {} and plan.replan is None
    assert plan.verdict == "relaunchable" and "--exclude=node9" in plan.command


def test_too_few_nodes_left_with_the_jobs_own_exclusions_is_refused_naming_them(run, fakes,
                                                                                monkeypatch):
    from mscale.recover import replan

    monkeypatch.setattr(stages, "replan", replan.replan)
    fakes.exclusions = Exclusions(nodes=["node3"], reasons={"node3": "diagnosis: gpu"})
    plan = plan_recovery(str(run), RecoverOptions(recheck=False,
                                                  command=srun_command(run, "node[1-2,4]")))
    assert plan.verdict == "unrecoverable" and plan.command == []
    assert "every node of the plan is excluded (node[1-4])" in plan.reasons[0]


def test_the_slurm_jobs_excluded_nodes_are_asked_of_scontrol_once(run, real_replan,
                                                                    monkeypatch):
    """The recorded job's ExcNodeList (an operator's `scontrol update` since) counts in the
    re-plan, and the relaunch uses the same answer instead of asking again."""
    from mscale.recover import relaunch

    asked = []

    def scontrol(argv):
        asked.append(argv)
        return 0, ("JobId=7 JobState=FAILED BatchFlag=1 Command=/nonexistent/job.sh "
                   "ExcNodeList=node2 Partition=debug")

    monkeypatch.setattr(relaunch, "run_quiet", scontrol)
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run)]
    write_events(run, [
        {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
            "launcher": "slurm", "attempt": 1, "launch": {
                "argv": argv, "cwd": str(run.parent), "plan": str(run / "plan.yaml"),
                "local": 0, "nodes": NODES, "slurm": {"job_id": "7", "job_name": "j",
                                                      "nodelist": "node[1-4]", "nnodes": 4}}}},
        {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5], "nodes": ["node3"]}])
    plan = plan_recovery(str(run), RecoverOptions(recheck=False))
    assert len(asked) == 1 and plan.exclusions.carried == {
        "node2": "kept out of the job's allocation before this recovery (scontrol's "
                 "ExcNodeList)"}
    assert "node2" not in plan.replan.nodes and plan.command[0] == "sbatch"
    assert f"--nodes={len(plan.replan.nodes)}" in plan.command
    assert "--exclude=node2" in plan.command
