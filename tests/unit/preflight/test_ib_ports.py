"""IB/RoCE ports from fixture sysfs trees: state, trained rate and counter deltas over a window."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from mscale.errors import MscaleError
from mscale.preflight.ib_ports import check_sysfs_root, judge_ports, snapshot

FIXTURE = Path(__file__).parent / "fixtures" / "sysfs-hdr"


@pytest.fixture
def sysfs(tmp_path):
    """A writable copy of the two-port HDR fixture tree."""
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE, root)
    return root


def _set(root, port, name, value):
    dev, num = port.split("/")
    base = root / "class" / "infiniband" / dev / "ports" / num
    (base / ("counters/" + name if name not in ("state", "phys_state", "rate") else name)
     ).write_text(f"{value}\n")


def _judge(root, change, window_s=10.0, expected=200, nics=2):
    before = snapshot(str(root))
    change(root)
    after = snapshot(str(root))
    after = replace(after, t=before.t + window_s)
    return {r.entity: r for r in judge_ports(before, after, "node1", expected_gbps=expected,
                                             nics=nics)}


def test_healthy_fixture_is_ok():
    snap = snapshot(str(FIXTURE))
    results = judge_ports(snap, replace(snap, t=snap.t + 5), "node1", expected_gbps=200, nics=2)
    assert [(r.entity, r.status, r.value) for r in results] == [
        ("node1:mlx5_0/1", "OK", 200.0), ("node1:mlx5_1/1", "OK", 200.0)]
    assert results[0].evidence["modulation"] == "PAM4"


def test_link_downed_increment_is_critical(sysfs):
    r = _judge(sysfs, lambda root: _set(root, "mlx5_1/1", "link_downed", 1))
    assert r["node1:mlx5_1/1"].status == "CRITICAL"
    assert "link_downed +1" in r["node1:mlx5_1/1"].message
    assert r["node1:mlx5_0/1"].status == "OK"


def test_symbol_errors_on_pam4_below_rate_threshold_are_ok(sysfs):
    # 200 Gb/s for 10 s is 2e12 bits: one new error is a BER of 5e-13, under 1e-12.
    r = _judge(sysfs, lambda root: _set(root, "mlx5_0/1", "symbol_error", 4))
    assert r["node1:mlx5_0/1"].status == "OK"
    assert r["node1:mlx5_0/1"].evidence["deltas"]["symbol_error"] == 1


def test_symbol_errors_above_rate_threshold_warn(sysfs):
    r = _judge(sysfs, lambda root: _set(root, "mlx5_0/1", "symbol_error", 3 + 50))
    assert r["node1:mlx5_0/1"].status == "WARNING"
    assert "bit error rate" in r["node1:mlx5_0/1"].message


def test_degraded_rate_is_critical(sysfs):
    r = _judge(sysfs, lambda root: _set(root, "mlx5_1/1", "rate", "100 Gb/sec (2X HDR)"))
    assert r["node1:mlx5_1/1"].status == "CRITICAL" and "2X HDR" in r["node1:mlx5_1/1"].message


def test_down_port_is_critical_only_when_ports_are_short(sysfs):
    def down(root):
        _set(root, "mlx5_1/1", "state", "1: DOWN")
        _set(root, "mlx5_1/1", "phys_state", "3: Disabled")
    assert _judge(sysfs, down, nics=2)["node1:mlx5_1/1"].status == "CRITICAL"
    assert _judge(sysfs, down, nics=1)["node1:mlx5_1/1"].status == "OK"


def test_counter_reset_is_not_a_negative_delta(sysfs):
    _set(sysfs, "mlx5_0/1", "link_error_recovery", 7)
    r = _judge(sysfs, lambda root: _set(root, "mlx5_0/1", "link_error_recovery", 0))
    assert r["node1:mlx5_0/1"].status == "OK"


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_sysfs_root_that_is_not_a_sysfs_tree_is_bad_input(tmp_path, make):
    with pytest.raises(MscaleError, match="sysfs") as e:
        check_sysfs_root(str(make(tmp_path)))
    assert e.value.code == 3


def test_fixture_is_a_sysfs_tree_and_no_devices_is_empty(tmp_path):
    check_sysfs_root(str(FIXTURE))
    (tmp_path / "class").mkdir()
    assert snapshot(str(tmp_path)).ports == {}
