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
