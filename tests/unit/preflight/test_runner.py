"""What a preflight rank refuses before it joins the job (`preflight/runner.py`)."""

from __future__ import annotations

import pytest

from mscale.errors import MscaleError
from mscale.preflight import runner
from mscale.preflight.options import PreflightOptions
from mscale.topology.placement import load_checked_plan
from tests.conftest import PLANS

SRUN = {"SLURM_NTASKS": "8", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node[1-4]",
        "SLURM_NNODES": "4", "SLURMD_NODENAME": "node1"}
"""srun's view of a task of an 8-task step on cpu-tiny's four nodes (2 a node in the plan)."""


@pytest.mark.parametrize("step, field", [
    ({"SLURM_PROCID": "3", "SLURM_NODEID": "0", "SLURM_LOCALID": "3",
      "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, "cluster.gpus_per_node"),  # -N 2 -n 8
    ({"SLURM_PROCID": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "2",
      "SLURM_STEP_TASKS_PER_NODE": "3(x2),2"}, "placement"),  # -N 3 -n 8: 3,3,2
    ({"SLURM_PROCID": "2", "SLURM_NODEID": "2", "SLURM_LOCALID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_DISTRIBUTION": "cyclic"}, "placement"),
])
def test_a_launch_train_would_refuse_is_refused_before_the_rendezvous(monkeypatch, tmp_path,
                                                                      step, field):
    """The same srun line train refuses ran preflight on it: with 4 tasks a node, the plan's
    node-1 TP pair (ranks 2, 3) shared node 0 with ranks 0, 1, so preflight tested other links
    than the job would use, and blamed the nodes SLURM named for them."""
    for key in list(runner.os.environ):
        if key.startswith("SLURM_") or key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in {**SRUN, **step}.items():
        monkeypatch.setenv(key, value)

    def joined(*a, **k):
        raise AssertionError("joined the job: the launch was not checked")

    monkeypatch.setattr("mscale.distributed.init.init_distributed", joined)
    plan = load_checked_plan(str(PLANS / "cpu-tiny.yaml"))
    with pytest.raises(MscaleError) as e:
        runner.run_preflight_worker(plan, PreflightOptions(run_dir=str(tmp_path / "run")))
    assert e.value.code == 3 and e.value.field == field
    assert not (tmp_path / "run").exists()
