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


def test_a_launched_rank_leaves_the_data_and_run_checks_to_its_worker(tmp_path, monkeypatch):
    """Under srun/torchrun every rank runs `mscale train`. Checking the data and the checkpoint
    to resume there cost each of 12,288 ranks a parse of its manifest (~430 MB in schema 1); on
    rank 0 alone it
    held the others at the rendezvous past --timeout. The workers check them after it. Without
    a launcher (and for the --local launcher) they are checked here: a missing file is exit 3
    before any process starts."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml")).model_dump(mode="json", exclude_none=True)
    plan["training"]["data"] = {"kind": "tokens", "path": str(tmp_path / "missing.bin")}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    options = TrainOptions(run_dir=str(tmp_path / "run"))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MscaleError, match="missing.bin|no such file"):
        check_before_launch(str(path), options, 8)  # the --local launcher
    with pytest.raises(MscaleError, match="missing.bin|no such file"):
        check_before_launch(str(path), options, 0)  # no launcher
    for rank in ("0", "3"):
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("RANK", rank)
        assert check_before_launch(str(path), options, 0).layout.world_size == 8


def test_a_missing_relative_data_path_names_the_plan_and_the_current_directory(tmp_path,
                                                                               monkeypatch):
    """`cd /tmp && mscale train /path/plans/cpu-text.yaml`: the plan's relative data path is
    taken from /tmp; the error names the plan, its field and the directory it was taken from."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml")).model_dump(mode="json", exclude_none=True)
    plan["training"]["data"] = {"kind": "tokens", "path": "runs/demo/tokens"}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MscaleError) as e:
        check_before_launch(str(path), TrainOptions(run_dir=str(tmp_path / "run")), 8)
    assert e.value.file == str(path) and e.value.field == "training.data.path"
    assert f"current directory ({elsewhere})" in e.value.message
    assert "absolute path" in e.value.fix


@pytest.mark.parametrize("field, value", [("micro_batch", 4), ("zero_stage", 2),
                                          ("recompute", "full")])
def test_a_training_choice_the_layout_contradicts_is_refused(tmp_path, monkeypatch, field, value):
    """A plan's layout is what trains: `micro_batch: 4` edited into its training section (where
    a training file sets it) trained at the layout's 2 without a word. It is exit 3 naming both
    fields, before any process starts."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml")).model_dump(mode="json", exclude_none=True)
    plan["training"][field] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(MscaleError) as e:
        check_before_launch(str(path), TrainOptions(run_dir=str(tmp_path / "run")), 8)
    assert e.value.file == str(path) and e.value.field == f"training.{field}"
    assert f"layout.{field} is {plan['layout'][field]}" in e.value.message
    assert f"layout.{field}: {value}" in e.value.fix
    assert not (tmp_path / "run").exists()


def test_the_launcher_takes_a_fixed_plan_for_a_run_that_never_trained(tmp_path, monkeypatch):
    """A first start that failed before step 1 left its plan.yaml (a model too big for the
    GPUs): `--local` refused the fixed one as "another model or training recipe", though the
    run had no step and no checkpoint. Once a step trained it is refused."""
    from mscale.runs.history import plan_change_of, write_plan
    from mscale.runs.rundir import RunDir
    from tests.unit.runs.test_history import _plan, trained

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    run = RunDir(str(tmp_path / "run"))
    run.create()
    too_big = _plan(model={"hidden": 128})
    write_plan(run, too_big, plan_change_of(run, too_big))
    options = TrainOptions(run_dir=run.root)
    assert check_before_launch(str(PLANS / "cpu-tiny.yaml"), options, 8).model.hidden == 64
    trained(run)
    with pytest.raises(MscaleError, match="another model or training recipe"):
        check_before_launch(str(PLANS / "cpu-tiny.yaml"), options, 8)
