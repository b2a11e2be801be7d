"""Storage check: a store slower than the plan's checkpoint needs is CRITICAL, a fast one OK, an
unreachable URL is bad input naming it, and the probe leaves nothing behind."""

import time

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from mscale.config.plan import CheckpointAdvice, load_plan
from mscale.config.preflight import CheckResult
from mscale.errors import MscaleError
from mscale.preflight.options import PreflightOptions
from mscale.preflight.report import finish
from mscale.preflight.storage import check_storage_url, storage_checks, storage_need
from tests.conftest import PLANS

PROBE = 256 << 10


def _plan(need_mb_per_s: float):
    """cpu-tiny with a checkpoint interval chosen so that one node must write ``need`` MB/s."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    share = storage_need(plan).node_bytes
    plan.checkpoint = CheckpointAdvice(interval_steps=1, interval_s=share / (need_mb_per_s * 1e6),
                                       mtbf_h=1, checkpoint_cost_s=0, restart_s=0,
                                       effective_training=1)
    return plan


class _Slow:
    """A file whose reads and writes take ``len / bytes_per_s`` seconds."""

    def __init__(self, f, bytes_per_s):
        self._f, self._bps = f, bytes_per_s

    def write(self, data):
        time.sleep(len(data) / self._bps)
        return self._f.write(data)

    def read(self, n=-1):
        data = self._f.read(n)
        time.sleep(len(data) / self._bps)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


class ThrottledFS(MemoryFileSystem):
    """An in-memory filesystem that moves 1 MB/s: a storage target slower than needed."""

    protocol = "throttled"
    bytes_per_s = 1e6

    def _open(self, path, mode="rb", **kwargs):
        return _Slow(super()._open(path, mode, **kwargs), self.bytes_per_s)


def test_throttled_store_is_critical_and_leaves_nothing():
    fs = ThrottledFS()
    results = storage_checks("throttled://ckpt", _plan(10), "node1", probe_bytes=PROBE, fs=fs)
    by = {r.check: r for r in results}
    assert by["storage_write"].status == "CRITICAL"
    assert by["storage_read"].status == "CRITICAL"
    assert by["storage_write"].value < 1.1 and by["storage_write"].node == "node1"
    assert "cannot keep up" in by["storage_write"].message
    assert not fs.exists("/ckpt")


def test_a_slow_store_is_judged_within_the_jobs_timeout(monkeypatch):
    """The node's other ranks wait for its host checks under --timeout: a 1 GiB probe of a
    slow store (`--level full`) ran past it, and the whole preflight ended UNKNOWN (exit 3)
    blaming a lost peer. The probe now stops at its share of the timeout, judged on what it
    moved."""
    import mscale.preflight.storage as storage

    monkeypatch.setattr(storage, "BLOCK_BYTES", 128 << 10)
    fs = ThrottledFS()
    t0 = time.perf_counter()
    results = storage_checks("throttled://ckpt", _plan(10), "node1", probe_bytes=2 << 20,
                             fs=fs, timeout_s=1.0)
    took = time.perf_counter() - t0
    by = {r.check: r for r in results}
    assert took < 1.0, took  # unbounded: 2 × 2.1 s
    assert by["storage_write"].status == by["storage_read"].status == "CRITICAL"
    assert 0.5 < by["storage_write"].value < 1.1
    assert "cut short after 0.3 s" in by["storage_write"].message
    assert not fs.exists("/ckpt")


def test_fast_store_is_ok_with_free_space(tmp_path):
    url = str(tmp_path / "run" / "ckpt")
    results = storage_checks(url, _plan(0.01), "node1", probe_bytes=PROBE)
    assert {r.check: r.status for r in results} == {
        "storage_write": "OK", "storage_read": "OK", "free_space": "OK"}
    assert not (tmp_path / "run").exists()  # the probe created it, and removed it


def test_free_space_short_of_one_checkpoint_is_critical(tmp_path, monkeypatch):
    import shutil
    usage = shutil.disk_usage(tmp_path)
    need = storage_need(_plan(0.01)).total_bytes
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=int(need / 2)))
    (r,) = [r for r in storage_checks(str(tmp_path), _plan(0.01), "n", probe_bytes=PROBE)
            if r.check == "free_space"]
    assert r.status == "CRITICAL"


def test_failing_store_is_critical_for_the_node():
    class Broken(MemoryFileSystem):
        protocol = "broken"

        def _open(self, path, mode="rb", **kwargs):
            raise OSError(5, "Input/output error")

    (r,) = storage_checks("broken://x", _plan(1), "node3", probe_bytes=PROBE, fs=Broken())
    assert (r.check, r.status, r.node) == ("storage_write", "CRITICAL", "node3")


@pytest.mark.parametrize("url", ["nosuch://bucket/ckpt", "{file}/ckpt"])
def test_unreachable_url_is_bad_input_naming_it(tmp_path, url):
    (tmp_path / "file").write_text("x")
    url = url.format(file=tmp_path / "file")
    with pytest.raises(MscaleError) as e:
        check_storage_url(url)
    assert e.value.code == 3 and url in str(e.value)


def test_unanswering_remote_is_bad_input(monkeypatch):
    class Down(MemoryFileSystem):
        protocol = "down"

        def pipe_file(self, *a, **k):
            raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr("mscale.preflight.storage.fs_and_path", lambda u: (Down(), "/x"))
    monkeypatch.setattr("mscale.preflight.storage.check_output", lambda *a, **k: None)
    with pytest.raises(MscaleError, match="cannot be reached.*Connection refused") as e:
        check_storage_url("down://x")
    assert e.value.file == "down://x"


def test_reachable_url_leaves_nothing():
    check_storage_url("memory://pf-reach/ckpt")
    assert not fsspec.filesystem("memory").exists("/pf-reach")


def test_a_probe_never_removes_another_nodes_probe(tmp_path):
    """Nodes probe the same checkpoint directory at once: the first to finish removes only its
    own probe and the parents it created that are empty, never the others' probes."""
    import fsspec

    from mscale.preflight.storage import _probe_dir

    fs = fsspec.filesystem("file")
    base = str(tmp_path / "run" / "ckpt")  # neither exists yet: both probes create them
    first, second = _probe_dir(fs, base), _probe_dir(fs, base)
    a, b = first.__enter__(), second.__enter__()
    first.__exit__(None, None, None)
    assert not fs.exists(a) and fs.exists(b)
    second.__exit__(None, None, None)
    assert not fs.exists(b)
    assert list((tmp_path / "run" / "ckpt").iterdir()) == []  # no probe left behind


def test_a_lone_probe_removes_the_parents_it_created(tmp_path):
    import fsspec

    from mscale.preflight.storage import _probe_dir

    with _probe_dir(fsspec.filesystem("file"), str(tmp_path / "run" / "ckpt")):
        pass
    assert list(tmp_path.iterdir()) == []


def _storage(node: str, status: str, check: str = "storage_write") -> CheckResult:
    return CheckResult(check=check, entity_kind="storage", entity="/ckpt", node=node,
                       status=status, message="write + fsync at 1 MB/s")


def test_a_store_failing_on_most_nodes_blames_none_of_them(tmp_path):
    """A shared store too slow or too full is the same store from every node: excluding the
    nodes would exclude the job. One node failing alone is its own mount."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    everywhere = [_storage(n, "CRITICAL") for n in ("node1", "node2")] + \
        [_storage(n, "CRITICAL", "free_space") for n in ("node1", "node2")]
    report = finish(plan, PreflightOptions(run_dir=str(tmp_path), plan_path="p.yaml"), 4, everywhere, {})
    assert report.bad_nodes == [] and report.exclude == "" and report.status == "CRITICAL"
    assert all(r.node and r.evidence["blamed"] is False and "no node is excluded" in r.message
               for r in report.results)
    one = [_storage("node1", "OK"), _storage("node2", "OK"), _storage("node3", "OK"),
           _storage("node4", "CRITICAL")]
    report = finish(plan, PreflightOptions(run_dir=str(tmp_path), plan_path="p.yaml"), 8, one, {})
    assert report.bad_nodes == ["node4"] and "blamed" not in report.results[3].evidence


def test_the_budget_bounds_a_local_stores_fsync(tmp_path, monkeypatch):
    """A local mount (NFS, Lustre) takes the probe's writes into the page cache at once and
    moves them at the fsync: the budget, checked only between writes, let a 1 GiB fsync run on
    past the job's timeout."""
    import os

    import mscale.preflight.storage as storage

    monkeypatch.setattr(storage, "BLOCK_BYTES", 128 << 10)
    monkeypatch.setattr(storage, "SYNC_BYTES", 256 << 10)
    done = {}

    def slow_fsync(fd):  # 1 MB/s for what has not been synced yet
        size = os.fstat(fd).st_size
        time.sleep((size - done.get("n", 0)) / 1e6)
        done["slept"] = done.get("slept", 0.0) + (size - done.get("n", 0)) / 1e6
        done["n"] = size

    monkeypatch.setattr(storage.os, "fsync", slow_fsync)
    results = storage_checks(str(tmp_path / "ckpt"), _plan(10), "node1", probe_bytes=2 << 20,
                             timeout_s=1.0)
    # the fsyncs' own time, not the wall clock (a loaded machine adds to that): the budget is
    # 0.3 s, a sync 0.26 s; unbounded, the one fsync at the end took 2.1 s
    assert done["slept"] < 1.5
    write = {r.check: r for r in results}["storage_write"]
    assert write.status == "CRITICAL" and "cut short" in write.message
