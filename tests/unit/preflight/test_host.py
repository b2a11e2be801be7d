"""node_checks: one node's host checks together, as the runner calls them."""

from pathlib import Path

import pytest

from mscale.config.plan import load_plan
from mscale.errors import MscaleError
from mscale.preflight.host import check_inputs, node_checks
from tests.conftest import PLANS
from tests.unit.preflight.test_gpu_health import fake_nvml

FIXTURE = str(Path(__file__).parent / "fixtures" / "sysfs-hdr")


def test_cpu_plan_checks_storage_env_and_ports_only(tmp_path):
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    out = node_checks(str(tmp_path / "run"), plan, level="quick", sysfs_root=FIXTURE,
                      node="node2", env={})
    assert {r.check for r in out} == {"nccl_env", "storage_write", "storage_read", "free_space",
                                      "ib_port"}
    assert {r.status for r in out} == {"OK"} and {r.node for r in out} == {"node2"}
    assert not (tmp_path / "run").exists()


def test_gpu_plan_without_nvml_or_ports_is_unknown_not_ok(tmp_path):
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    plan.cluster.gpu = plan.cluster.gpu.model_copy(update={"name": "H100"})
    (tmp_path / "sys" / "class").mkdir(parents=True)
    out = node_checks(str(tmp_path), plan, level="quick", sysfs_root=str(tmp_path / "sys"),
                      nvml=fake_nvml({}, init_error="Driver Not Loaded"), node="n", env={})
    by = {r.check: r.status for r in out}
    assert by["gpu_health"] == "UNKNOWN" and by["ib_port"] == "UNKNOWN"


def test_bad_inputs_are_exit_3(tmp_path):
    with pytest.raises(MscaleError, match="sysfs") as e:
        check_inputs(str(tmp_path), sysfs_root=str(tmp_path))
    assert e.value.code == 3
    with pytest.raises(MscaleError, match="nosuch"):
        check_inputs(str(tmp_path), sysfs_root=FIXTURE, storage_url="nosuch://b/ckpt")
    check_inputs(str(tmp_path / "run"), sysfs_root=FIXTURE)
    assert not (tmp_path / "run").exists()
