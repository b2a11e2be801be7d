"""recover/replan.py: shrink DP first, else search, else the best subset of nodes; the plan is
written where recover keeps its files, names the remaining nodes, and train's checks accept it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from mscale.config.plan import Plan
from mscale.errors import MscaleError
from mscale.recover.decision import Exclusions
from mscale.recover.replan import nearest_batches, plan_nodes, replan
from mscale.runs.history import check_plan_change
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan, placement_for

PLAN = Path(__file__).resolve().parents[3] / "plans" / "cpu-tiny.yaml"  # tp2 pp2 dp2, node[1-4]


def tiny(**model) -> Plan:
    data = yaml.safe_load(PLAN.read_text())
    data["model"].update(model)
    return Plan.model_validate(data)


@pytest.fixture
def run(tmp_path) -> RunDir:
    r = RunDir(str(tmp_path / "run"))
    r.create()
    return r


def out(*nodes):
    return Exclusions(nodes=list(nodes), reasons={n: "test" for n in nodes})


def test_no_node_of_the_plan_excluded(run):
    assert replan(run, tiny(), out("node9")) is None
    assert replan(run, tiny(), Exclusions()) is None


def test_dp_shrinks_first_and_the_batch_is_kept(run):
    plan = tiny()
    rp = replan(run, plan, out("node3", "node4"))
    assert rp.plan_path == f"{run.recover}/plan-0001.yaml" and os.path.isfile(rp.plan_path)
    assert rp.nodes == ["node1", "node2"] and rp.world == 4 and rp.unused_nodes == []
    assert rp.layout == "tp2 pp2 dp1 on 2 nodes (cpu-4x2)"
    assert rp.old_layout == "tp2 pp2 dp2 on 4 nodes (cpu-4x2)"
    assert rp.global_batch == 16 and not rp.batch_changed
    assert 0 < rp.old_step_time_s < rp.new_step_time_s
    assert "kept tp2 pp2, dp 2 -> 1, 4 -> 8 micro-batches per step" in rp.note
    assert rp.note.startswith("predicted step time") and "on 2 of 4 nodes" in rp.note
    assert "on CPUs not a prediction" in rp.note  # the planner's rates are GPUs'
    new = load_checked_plan(rp.plan_path)
    lay = new.layout
    assert (lay.tp, lay.pp, lay.dp, lay.micro_batch, lay.sequence_parallel) == (2, 2, 1, 2, True)
    assert new.cluster.hostlist == "node[1-2]" and new.placement.nodes == ["node1", "node2"]
    assert new.checkpoint == plan.checkpoint
    change = check_plan_change(plan, new)  # what train checks when it claims the run
    assert change.kind == "changed" and change.relayout


def test_dry_run_names_the_file_without_writing_it(run):
    rp = replan(run, tiny(), out("node4"), write=False)
    assert rp.plan_path == f"{run.recover}/plan-0001.yaml" and not os.path.exists(rp.plan_path)


def test_search_when_tp_pp_cannot_stay_and_local_names_follow(run):
    """3 nodes of 2 cannot hold tp2·pp2: the planner's search picks another split on all 6
    ranks, and `--local 6` names the nodes node1, node2, node4 (2 ranks each) as the plan does."""
    rp = replan(run, tiny(), out("node3"))
    assert rp.world == 6 and rp.nodes == ["node1", "node2", "node4"] and not rp.unused_nodes
    assert "planner search" in rp.note and rp.global_batch == 16
    new = load_checked_plan(rp.plan_path)
    assert plan_nodes(new) == ["node1", "node2", "node4"]
    p = placement_for(new)
    assert [new.cluster.node_names()[p.node(r)] for r in range(6)] == [
        "node1", "node1", "node2", "node2", "node4", "node4"]
    assert check_plan_change(tiny(), new).relayout


def test_slurms_names_count_when_the_plan_names_its_nodes_otherwise(run):
    """The plan names gpu[01-04]; SLURM ran the attempt on node[1-4] (its start event's nodes)
    and node3 is excluded by SLURM's name: the re-plan subtracts it (it used to find no plan
    node excluded and relaunch on 4 nodes of 3), and the new plan names the nodes left so."""
    data = yaml.safe_load(PLAN.read_text())
    data["cluster"]["hostlist"] = "gpu[01-04]"
    plan = Plan.model_validate(data)
    ran = ["node1", "node2", "node3", "node4"]
    assert plan_nodes(plan, ran) == ran and plan_nodes(plan, ran[:3]) == plan_nodes(plan)
    assert replan(run, plan, out("gpu03"), ran=ran) is None  # not a node SLURM knows
    rp = replan(run, plan, out("node3"), ran=ran)
    assert rp.world == 6 and rp.nodes == ["node1", "node2", "node4"]
    new = load_checked_plan(rp.plan_path)
    assert new.cluster.hostlist == "node[1-2,4]" and plan_nodes(new) == rp.nodes


def test_largest_subset_when_no_layout_fits_all_remaining(run):
    """A 2-layer model on 3 nodes of 2: 6 ranks cannot split a batch of 16 (pp <= 2): two
    nodes run it, the third stays idle, and the batch is not touched."""
    plan = tiny(layers=2)
    rp = replan(run, plan, out("node2"))
    assert rp.nodes == ["node1", "node3"] and rp.unused_nodes == ["node4"] and rp.world == 4
    assert rp.global_batch == 16 and not rp.batch_changed
    assert "1 healthy node(s) idle" in rp.note


def test_allowed_batch_change_uses_every_remaining_node(run):
    """The same 3 nodes with the batch allowed to move: the nearest batch 6 ranks divide (18),
    written in a plan that train accepts under --allow-batch-change and refuses without it."""
    plan = tiny(layers=2)
    rp = replan(run, plan, out("node2"), allow_batch_change=True)
    assert rp.batch_changed and rp.global_batch == 18 and rp.world == 6 and rp.unused_nodes == []
    assert rp.nodes == ["node1", "node3", "node4"]
    new = load_checked_plan(rp.plan_path)
    assert check_plan_change(plan, new, allow_batch_change=True).kind == "changed"
    with pytest.raises(MscaleError, match="global batch"):
        check_plan_change(plan, new)


def test_nearest_batches():
    assert nearest_batches(16, 6, 2) == [18, 12, 24]
    assert nearest_batches(16, 4, 1) == []  # every dp of 4 ranks already divides 16


def test_everything_excluded_or_nothing_fits(run):
    with pytest.raises(MscaleError, match="every node of the plan is excluded"):
        replan(run, tiny(), out("node1", "node2", "node3", "node4"))
    big = tiny(hidden=4096, ffn_hidden=16384, vocab=32000, heads=32, kv_heads=8, layers=2)
    with pytest.raises(MscaleError, match="no layout runs global batch 16"):
        replan(run, big, out("node1", "node2", "node3"))
