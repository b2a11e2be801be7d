"""topology/env.py: the no-launcher error names the command that is running, and one node has one
name (the plan's under --local, the launcher's otherwise)."""

from __future__ import annotations

import os

import pytest

from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.topology.env import NoLauncherError, node_name, read_launch_env
from mscale.topology.placement import load_checked_plan

from tests.conftest import PLANS


@pytest.mark.parametrize("command", ["train", "preflight"])
def test_no_launcher_fix_names_the_command_that_runs(command):
    with pytest.raises(NoLauncherError) as e:
        read_launch_env({}, command=command, world=8)
    err = e.value
    assert isinstance(err, MscaleError) and err.code == EXIT_BAD_INPUT
    assert f"mscale {command} PLAN --run-dir DIR --local 8" in err.fix
    other = {"train": "preflight", "preflight": "train"}[command]
    assert f"mscale {other}" not in err.fix  # the old fix sent preflight's user to train
    assert "\n" not in err.message and "\n" not in err.fix


def test_no_launcher_fix_without_a_command_sends_nobody_to_another_command():
    with pytest.raises(NoLauncherError) as e:
        read_launch_env({})
    assert "srun or torchrun" in e.value.fix and "PLAN --local" not in e.value.fix


def _env(**extra):
    base = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "2"}
    return read_launch_env({**base, **extra})


def test_node_name_is_the_plans_under_local_the_launchers_otherwise():
    plan = load_checked_plan(str(PLANS / "cpu-tiny.yaml"))  # node[1-4], 2 ranks per node
    assert node_name(_env(MSCALE_LAUNCHER="local"), plan) == "node3"  # as --local's launcher says
    assert node_name(_env(SLURMD_NODENAME="gpu017"), plan) == "gpu017"  # srun torchrun
    assert node_name(_env(), plan) == os.uname().nodename  # plain torchrun: the host


def _srun(**extra: str):
    """What srun gives task 5 of 8 (2 a node) inside a 4-node allocation."""
    base = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
            "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_NNODES": "4",
            "SLURMD_NODENAME": "node3"}
    return read_launch_env({**base, **extra})


def test_srun_rendezvous_is_the_steps_first_node_not_the_allocations():
    """A relaunch that excludes node1 inside the allocation runs its rank 0 on node2: every rank
    waited at node1 until --timeout."""
    assert _srun().master_addr == "node1"
    assert _srun(SLURM_STEP_NODELIST="node[2-4]", SLURM_STEP_NUM_NODES="3").master_addr == "node2"
    assert _srun(SLURM_STEP_NODELIST="node[2-4]", MASTER_ADDR="10.0.0.9").master_addr == "10.0.0.9"


def test_srun_tasks_per_node_are_read_per_node_and_an_uneven_or_cyclic_step_is_refused_alike():
    from mscale.topology.env import slurm_tasks_per_node

    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_tasks_per_node("3,3,2") == [3, 3, 2] and slurm_tasks_per_node("x") == []
    even = _srun(SLURM_STEP_TASKS_PER_NODE="2(x4)")
    assert even.local_world_size == 2 and even.step_layout_problem is None
    uneven = _srun(SLURM_STEP_TASKS_PER_NODE="3(x2),2", SLURM_NNODES="3", SLURM_NODEID="2")
    assert uneven.local_world_size == 2  # this node's own count, not 8 // 3
    assert "runs 3,3,2 tasks on its 3 nodes" in uneven.step_layout_problem
    cyclic = _srun(SLURM_STEP_TASKS_PER_NODE="2(x4)", SLURM_DISTRIBUTION="cyclic")
    assert "distribution is cyclic" in cyclic.step_layout_problem
    assert _srun(SLURM_DISTRIBUTION="block:cyclic").step_layout_problem is None  # sockets only


def test_one_task_a_node_is_not_refused_for_srun_s_default_cyclic_distribution():
    """sbatch --ntasks-per-node=1: srun sets SLURM_DISTRIBUTION=cyclic, the same layout as block;
    every rank refused it, with a fix that was the very line it ran."""
    one = _srun(SLURM_PROCID="2", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="2",
                SLURM_STEP_TASKS_PER_NODE="1(x4)", SLURM_DISTRIBUTION="cyclic")
    assert one.local_world_size == 1 and one.step_layout_problem is None


def test_every_rank_refuses_a_step_the_plan_cannot_match():
    from mscale.topology.env import check_node_matches

    plan = load_checked_plan(str(PLANS / "cpu-tiny.yaml"))
    for rank, node in ((0, "0"), (5, "2"), (7, "3")):  # even those placed where the plan says
        env = _srun(SLURM_PROCID=str(rank), SLURM_NODEID=node,
                    SLURM_STEP_TASKS_PER_NODE="2(x4)", SLURM_DISTRIBUTION="cyclic")
        with pytest.raises(MscaleError, match="distribution is cyclic") as e:
            check_node_matches(plan, env)
        assert "srun -N 4 --ntasks-per-node 2" in e.value.fix
