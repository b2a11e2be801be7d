"""bench/gpu_check.py, its checks (gpu_checks.py) and their plans and runs (gpu_plans.py): the
script a session lent a GPU runs first.

It runs rarely and for minutes, so what can be checked here is: the plans its checks write are
valid plans, its prediction is the planner's own, its medians leave the warm-up out, the driver
skips what the budget cannot hold, and the timers check judges what a CPU can (the whole
rehearsal on the CPU, `bench/gpu_check.py --rehearse`, takes ~4 minutes and is run by hand
before a GPU run).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mscale.config.plan import load_plan

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def plans():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_plans")
    finally:
        sys.path.remove(str(BENCH))


def test_the_plans_a_check_writes_are_valid_and_say_what_changed(plans, tmp_path):
    ctx = plans.Context(out=tmp_path, work=tmp_path)
    assert plans.plan_file(ctx, "plans/gpu-1b-h200.yaml").name == "gpu-1b-h200.yaml"  # as is
    eager = load_plan(str(plans.plan_file(ctx, "plans/gpu-1b-h200.yaml", compile=False,
                                           tag="-eager")))
    assert eager.training.compile is False and eager.model.layers == 16
    short = load_plan(str(plans.plan_file(ctx, "plans/gpu-3b-h200.yaml", layers=4)))
    assert short.model.layers == 4 and short.model.hidden == 3072
    assert "estimate" not in yaml.safe_load((tmp_path / "gpu-3b-h200.yaml").read_text())
    tiny = load_plan(str(plans.plan_file(plans.Context(tmp_path, tmp_path, rehearse=True),
                                          "plans/gpu-1b-h200.yaml")))
    assert tiny.model.hidden == plans.TINY_MODEL["hidden"] and tiny.training.compile is True


def test_the_prediction_is_the_planners_for_the_plan_as_written(plans):
    """plans/gpu-3b-h200.yaml was written by `mscale plan`: its estimate is the same number."""
    path = BENCH.parent / "plans" / "gpu-3b-h200.yaml"
    want = yaml.safe_load(path.read_text())["estimate"]["step_time_s"]
    assert plans.predicted_step_s(path) == pytest.approx(want, rel=1e-3)


def test_medians_leave_the_warm_up_steps_out(plans):
    recs = [dict(step=i + 1, mfu=0.01 if i < plans.WARMUP else 0.5, tokens_per_s=1.0,
                 step_time=[9.0 if i < plans.WARMUP else 1.0], compute_time=[1.0],
                 comm_wait=[0.0], data_time=[0.0], bubble_time=[0.0]) for i in range(9)]
    m = plans.medians(recs)
    assert m["mfu"] == 0.5 and m["step_time"] == 1.0 and m["steps"] == "6..9"


def test_the_driver_skips_what_the_budget_cannot_hold(tmp_path):
    """A budget of 30 s holds none of the GPU checks but the 20-second ones; nothing runs long."""
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--rehearse", "--out",
                        str(tmp_path), "--budget", "30", "--only", "train-1b", "hier-dp"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "== train-1b: SKIP, 30 s of the budget left and it takes ~150 s" in p.stdout
    assert "hier-dp SKIP" in p.stdout  # 120 s > budget as well
    assert (tmp_path / "gpu-check.txt").read_text().count("== summary:") == 1


def test_an_unknown_check_is_refused_before_anything_runs(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--rehearse", "--out",
                        str(tmp_path), "--only", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "unknown check(s) ['nope']" in p.stderr


def test_missing_requirements_are_named_before_any_check(plans):
    """The device image lacked tensorboardX, which every training check needs: the driver names
    such a package first. Here (pip install -e .) nothing is missing."""
    driver = importlib.import_module("gpu_check")
    assert driver.missing_requirements() == []
    have = {"tensorboardx": None, "torch": "2.3.1"}
    missing = driver.missing_requirements(lambda name: have.get(name.lower(), "9999.1"))
    assert any(m.startswith("tensorboardX") for m in missing)
    assert any(m.startswith("torch") and "(have 2.3.1)" in m for m in missing)
    assert len(missing) == 2


@pytest.mark.parametrize("name, mib, preset", [
    ("NVIDIA H200", 143771, "H200"), ("NVIDIA H100 80GB HBM3", 81559, "H100"),
    ("NVIDIA H800", 81559, "H800"), ("NVIDIA A100-SXM4-80GB", 81920, "A100"),
    ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
    ("NVIDIA H100 PCIe", 81559, None), ("NVIDIA H100 NVL", 95830, None),  # slower parts
    ("NVIDIA H200 NVL", 143771, None), ("NVIDIA GH200 480GB", 97871, None),
    ("Tesla V100-SXM2-16GB", 16160, None)])
def test_the_gpu_found_maps_to_a_preset_only_where_its_peak_is_the_presets(plans, name, mib,
                                                                           preset):
    assert plans.gpu_preset(name, mib) == preset


def test_the_plans_are_retargeted_to_the_gpu_found_and_refit_its_memory(plans, tmp_path):
    """A session may be lent an H100 (80 GB): the 1B plan keeps its layout there, the 3B plan
    (96 GB at 4 sequences a micro-batch) takes the planner's best layout that fits, and the
    metrics files say which card they came from."""
    ctx = plans.Context(out=tmp_path, work=tmp_path, gpu="H100")
    assert ctx.prefix == "h100"
    one = load_plan(str(plans.plan_file(ctx, "plans/gpu-1b-h200.yaml")))
    assert one.cluster.gpu.name == "H100" and one.name == "gpu-1b-h100"
    assert one.layout.micro_batch == 4 and one.training.micro_batch == 4
    three = load_plan(str(plans.plan_file(ctx, "plans/gpu-3b-h200.yaml")))
    assert three.cluster.gpu.memory_gb == 80 and three.training.global_batch == 16
    assert three.layout.micro_batch == three.training.micro_batch < 4
    from mscale.planner.cost import Problem, evaluate
    assert evaluate(Problem(three.model, three.training, three.cluster), three.layout).fits
    with pytest.raises(plans.NoFit, match="fits one A100-40GB in no layout"):
        plans.plan_file(plans.Context(tmp_path, tmp_path, gpu="A100-40GB"),
                         "plans/gpu-3b-h200.yaml")


def test_the_report_says_which_gpu_and_peak_the_figures_are_for(plans, tmp_path):
    driver = importlib.import_module("gpu_check")
    line = driver.gpu_line(plans.Context(tmp_path, tmp_path, gpu="H100"),
                           ("NVIDIA H100 80GB HBM3", "H100"))
    assert line.startswith("GPU: NVIDIA H100 80GB HBM3 (preset H100); the H200 plans retargeted")
    unknown = plans.Context(tmp_path, tmp_path, gpu=None)
    assert unknown.prefix == "gpu"
    assert "against the H200's peak, not this GPU's" in driver.gpu_line(
        unknown, ("NVIDIA H100 PCIe", None))


def test_the_timers_check_passes_real_timers_and_fails_timers_that_lose_a_region(
        monkeypatch, capsys):
    """The rehearsal judges each region against the host's own clock (on a shared CPU another
    process stalls any region, so a fixed split would fail at random); a timer that drops a
    region must still fail it."""
    sys.path.insert(0, str(BENCH))
    try:
        checks = importlib.import_module("gpu_checks")
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(checks, "CPU_MATMUL_SIDE", 256)
    assert checks.check_timers(None)
    from contextlib import contextmanager

    from mscale.train import timers

    @contextmanager
    def lost(self, name, link=None):
        yield  # the block's seconds are left to compute

    monkeypatch.setattr(timers.StepTimer, "region", lost)
    assert not checks.check_timers(None)
    assert "FAIL" in capsys.readouterr().out
