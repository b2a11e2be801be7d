"""`check_before_launch`: what `mscale train` checks before any process starts, and which
process checks it."""

from __future__ import annotations

import pytest
import yaml

from mscale.config.plan import load_plan
from mscale.errors import MscaleError
from mscale.train.launch import check_before_launch
from mscale.train.options import TrainOptions
from tests.conftest import PLANS


def test_only_rank_0_of_a_launched_job_checks_data_and_the_run(tmp_path, monkeypatch):
    """Under srun/torchrun each rank runs `mscale train`: 12,288 ranks each opening every source
    and parsing the checkpoint to resume read TBs before the rendezvous. Rank 0 checks for all;
    a missing data file is its exit 3, and the others go on to the rendezvous."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml")).model_dump(mode="json", exclude_none=True)
    plan["training"]["data"] = {"kind": "tokens", "path": str(tmp_path / "missing.bin")}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    options = TrainOptions(run_dir=str(tmp_path / "run"))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    assert check_before_launch(str(path), options, 0).layout.world_size == 8
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(MscaleError, match="missing.bin|no such file"):
        check_before_launch(str(path), options, 0)
