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


@pytest.mark.parametrize("sysfs", ["none", "two-hdr-ports"])
def test_a_one_node_gpu_plan_does_not_judge_the_nics_it_never_uses(tmp_path, sysfs):
    """plans/gpu-1b-h200.yaml (one H200, nics_per_node left at its default 8): a box with no
    InfiniBand was UNKNOWN (the job's exit 3), one with two HDR ports CRITICAL (6 of 8
    missing), its only node excluded. A 4-node plan still judges them."""
    root = FIXTURE if sysfs == "two-hdr-ports" else str(tmp_path / "sys")
    (tmp_path / "sys" / "class").mkdir(parents=True)
    nvml = fake_nvml({}, init_error="Driver Not Loaded")
    one = load_plan(str(PLANS / "gpu-1b-h200.yaml"))
    out = node_checks(str(tmp_path / "run"), one, level="quick", sysfs_root=root, nvml=nvml,
                      node="n", env={})
    assert "ib_port" not in {r.check for r in out}
    four = load_plan(str(PLANS / "cpu-tiny.yaml"))
    four.cluster.gpu = four.cluster.gpu.model_copy(update={"name": "H100"})
    out = node_checks(str(tmp_path / "run"), four, level="quick", sysfs_root=root, nvml=nvml,
                      node="n", env={})
    assert {r.status for r in out if r.check == "ib_port"} == (
        {"UNKNOWN"} if sysfs == "none" else {"OK"})


def test_bad_inputs_are_exit_3(tmp_path):
    with pytest.raises(MscaleError, match="sysfs") as e:
        check_inputs(str(tmp_path), sysfs_root=str(tmp_path))
    assert e.value.code == 3
    with pytest.raises(MscaleError, match="nosuch"):
        check_inputs(str(tmp_path), sysfs_root=FIXTURE, storage_url="nosuch://b/ckpt")
    check_inputs(str(tmp_path / "run"), sysfs_root=FIXTURE)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, says", [
    ('{"entries": [', "not valid JSON"),
    ('{"entries": [{"node": "gpu[017,203]", "reason": "by hand"}]}', "not one node name"),
    ('{"entries": [{"node": "node1 ", "reason": "by hand"}]}', "not one node name"),
])
def test_a_quarantine_that_does_not_read_is_refused_before_any_measuring(tmp_path, text, says):
    """Read by rank 0 only when the report was assembled, a broken quarantine.json failed the
    job after every measurement, none kept; a hostlist written as one entry's node crashed
    the exclude list (an internal error)."""
    (tmp_path / "quarantine.json").write_text(text)
    with pytest.raises(MscaleError, match=says) as e:
        check_inputs(str(tmp_path), sysfs_root=FIXTURE)
    assert e.value.code == 3 and e.value.file == str(tmp_path / "quarantine.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quarantine.json"]


@pytest.mark.parametrize("env, checks", [
    ({}, {"sysfs", "storage"}),  # no launcher: this process is the job
    ({"RANK": "0", "WORLD_SIZE": "8"}, {"sysfs", "storage"}),  # torchrun rank 0
    ({"RANK": "3", "WORLD_SIZE": "8"}, {"sysfs"}),  # another rank: its own node's sysfs only
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-4]"}, {"sysfs"}),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-4]"},
     {"sysfs", "storage"}),
    ({"RANK": "0", "WORLD_SIZE": "8", "MSCALE_LAUNCHER": "local"}, set()),  # launcher checked
])
def test_who_checks_the_host_inputs_comes_from_the_launch_environment(monkeypatch, env, checks):
    from mscale.preflight import host

    seen = set()
    monkeypatch.setattr(host, "check_sysfs_root", lambda root: seen.add("sysfs"))
    monkeypatch.setattr(host, "check_storage_url", lambda url: seen.add("storage"))
    host.check_inputs_here("run", sysfs_root="/sys", env=env)
    assert seen == checks
