"""A GPU plan on a machine without GPUs (train/off_gpu.py): refused before any worker starts
when it cannot fit in memory, and said at the start when it can."""

from __future__ import annotations

import pytest

from mscale.config.gpus import resolve_gpu
from mscale.errors import MscaleError
from mscale.topology.placement import load_checked_plan
from mscale.train.off_gpu import (bytes_per_process, check_fits_without_gpus, gpus_visible,
                                  memory_available, off_gpu_line)
from tests.conftest import PLANS

GPU_1B = str(PLANS / "gpu-1b-h200.yaml")
GIB = 2 ** 30


def _never(*_):
    raise AssertionError("not asked")


def test_a_1b_plan_that_cannot_fit_is_refused_naming_the_sizes_and_a_cpu_plan():
    plan = load_checked_plan(GPU_1B)
    each = bytes_per_process(plan)
    assert 20 * GIB < each < 60 * GIB  # 0.9B parameters in bf16 with fp32 Adam, activations
    with pytest.raises(MscaleError) as e:
        check_fits_without_gpus(plan, GPU_1B, 1, available=lambda: 16 * GIB,
                                visible=lambda: False)
    err = e.value
    assert (err.file, err.field, err.code) == (GPU_1B, "cluster.gpu", 3)
    assert "is for H200 GPUs and this machine has none" in err.message
    assert "17.2 GB is free" in err.message and "cpu-tiny.yaml" in err.fix


def test_it_is_let_through_with_gpus_room_a_cpu_plan_or_no_meminfo():
    plan = load_checked_plan(GPU_1B)
    check_fits_without_gpus(plan, GPU_1B, 1, available=_never, visible=lambda: True)
    check_fits_without_gpus(plan, GPU_1B, 1, available=lambda: 400 * GIB, visible=lambda: False)
    check_fits_without_gpus(plan, GPU_1B, 1, available=lambda: None, visible=lambda: False)
    tiny = str(PLANS / "cpu-tiny.yaml")
    check_fits_without_gpus(load_checked_plan(tiny), tiny, 8, available=_never, visible=_never)


def test_the_processes_on_this_machine_add_up():
    plan = load_checked_plan(GPU_1B)
    each = bytes_per_process(plan)
    check_fits_without_gpus(plan, GPU_1B, 1, available=lambda: 1.5 * each, visible=lambda: False)
    with pytest.raises(MscaleError, match="2 process"):
        check_fits_without_gpus(plan, GPU_1B, 2, available=lambda: 1.5 * each,
                                visible=lambda: False)


def test_gpus_are_visible_through_a_driver_device_unless_hidden():
    driver = {"/dev/nvidiactl"}.__contains__
    assert gpus_visible({}, driver)
    assert not gpus_visible({}, lambda p: False)
    assert not gpus_visible({"CUDA_VISIBLE_DEVICES": ""}, driver)
    assert not gpus_visible({"CUDA_VISIBLE_DEVICES": "-1"}, driver)
    assert gpus_visible({"CUDA_VISIBLE_DEVICES": "0,1"}, driver)


def test_memory_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   2048 kB\n")
    assert memory_available(str(meminfo)) == 2048 * 1024
    assert memory_available(str(tmp_path / "absent")) is None


def test_the_start_line_is_said_only_for_a_gpu_plan_on_the_cpu():
    plan = load_checked_plan(GPU_1B)
    line = off_gpu_line(plan, "cpu")
    assert line.startswith("note: plan gpu-1b-h200 is for H200 GPUs, but torch sees no GPU here")
    assert off_gpu_line(plan, "cuda") is None
    cpu = plan.model_copy(update={"cluster": plan.cluster.model_copy(
        update={"gpu": resolve_gpu("cpu")})})
    assert off_gpu_line(cpu, "cpu") is None
