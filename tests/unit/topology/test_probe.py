"""The launch probe without a launcher: the SLURM e2e tests skip off-root, this does not."""

from __future__ import annotations

import pytest

from mscale.errors import MscaleError
from mscale.topology.env import read_launch_env
from mscale.topology.probe import main, probe
from tests.conftest import PLANS

PLAN = str(PLANS / "cpu-tiny.yaml")


def slurm_env(rank: int, ntasks: int = 8) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2), "SLURM_JOB_NODELIST": "node[1-4]",
            "SLURMD_NODENAME": f"node{rank // 2 + 1}", "SLURM_JOB_ID": "42"}


def test_probe_places_rank_on_the_plans_node():
    rec = probe(PLAN, read_launch_env(slurm_env(5)))
    assert (rec["dp"], rec["pp"], rec["tp"]) == (0, 1, 1)
    assert rec["plan_node"] == "node3" and rec["node_match"]
    assert (rec["master_addr"], rec["master_port"]) == ("node1", 20042)


def test_probe_flags_a_node_mismatch():
    env = {**slurm_env(5), "SLURMD_NODENAME": "node4"}
    assert probe(PLAN, read_launch_env(env))["node_match"] is False


def test_probe_names_a_launch_train_and_preflight_would_refuse():
    """srun -N 3 -n 8 (3,3,2 tasks): rank 0 sits where the plan puts it, node_match true, yet
    every rank of the job refuses the step; the dry run said nothing of it."""
    assert probe(PLAN, read_launch_env(slurm_env(0)))["launch_problem"] is None
    env = {**slurm_env(0), "SLURM_STEP_TASKS_PER_NODE": "3(x2),2"}
    rec = probe(PLAN, read_launch_env(env))
    assert rec["node_match"] and "runs 3,3,2 tasks on its 3 nodes" in rec["launch_problem"]
    assert "fix: srun -N 4 --ntasks-per-node 2" in rec["launch_problem"]


def test_probe_refuses_a_wrong_world_size():
    with pytest.raises(MscaleError, match="needs 8"):
        probe(PLAN, read_launch_env(slurm_env(0, ntasks=2)))


def test_main_without_a_launcher_exits_3(monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    assert main([PLAN]) == 3
    assert "no launcher environment" in capsys.readouterr().err
