"""GPU health from fixture NVML answers (a module object with pynvml's functions); no NVML or no
driver is UNKNOWN with the reason, never OK."""

from types import SimpleNamespace

import pytest

from mscale.preflight import gpu_health as gh


class NVMLError(Exception):
    pass


def fake_nvml(*gpus, init_error=None):
    """A pynvml stand-in answering from one dict per GPU; a key set to NVMLError raises it."""
    def per_gpu(key):
        def f(h, *args):
            value = gpus[h].get(key, DEFAULT[key])
            if value is NVMLError:
                raise NVMLError("Not Supported")
            return value
        return f

    def init():
        if init_error:
            raise NVMLError(init_error)

    return SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus), nvmlDeviceGetHandleByIndex=lambda i: i,
        **{f"nvmlDeviceGet{k}": per_gpu(k) for k in DEFAULT})


DEFAULT = {"TotalEccErrors": 0, "RemappedRows": (0, 0, False, False),
           "CurrentClocksEventReasons": gh.SW_POWER_CAP, "CurrPcieLinkGeneration": 4,
           "CurrPcieLinkWidth": 16, "MaxPcieLinkWidth": 16, "ComputeRunningProcesses": []}


def _statuses(*gpus, **kw):
    return [(r.entity, r.status) for r in gh.gpu_health("n1", fake_nvml(*gpus), **kw)]


def test_healthy_gpus_are_ok():
    assert _statuses({}, {}) == [("n1:gpu0", "OK"), ("n1:gpu1", "OK")]


@pytest.mark.parametrize("answer,status,words", [
    ({"TotalEccErrors": 2}, "CRITICAL", "uncorrected ECC"),
    ({"RemappedRows": (1, 1, False, True)}, "CRITICAL", "remapping failed"),
    ({"RemappedRows": (0, 1, True, False)}, "WARNING", "pending"),
    ({"CurrentClocksEventReasons": gh.HW_SLOWDOWN | gh.SW_POWER_CAP}, "CRITICAL",
     "hardware slowdown"),
    ({"CurrentClocksEventReasons": gh.SW_THERMAL}, "WARNING", "software thermal"),
    ({"CurrPcieLinkWidth": 8}, "CRITICAL", "x8 of x16"),
    ({"CurrPcieLinkGeneration": 3}, "WARNING", "gen 3"),
    ({"ComputeRunningProcesses": [SimpleNamespace(pid=99999999, usedGpuMemory=3 << 30)]},
     "CRITICAL", "leftover"),
])
def test_each_problem_is_named(answer, status, words):
    (bad, good) = gh.gpu_health("n1", fake_nvml(answer, {}))
    assert (bad.status, good.status) == (status, "OK")
    assert words in bad.message and bad.node == "n1"


def test_idle_gpu_at_lower_pcie_gen_and_own_processes_are_ok():
    own = [SimpleNamespace(pid=4242, usedGpuMemory=1 << 30)]
    assert _statuses({"CurrPcieLinkGeneration": 1, "CurrentClocksEventReasons": gh.IDLE,
                      "ComputeRunningProcesses": own}, {}, ignore_pids=[4242]) == [
        ("n1:gpu0", "OK"), ("n1:gpu1", "OK")]


def test_unsupported_queries_are_skipped_not_failed():
    assert _statuses({"TotalEccErrors": NVMLError, "RemappedRows": NVMLError}) == [
        ("n1:gpu0", "OK")]


def test_no_driver_is_unknown_with_the_reason():
    (r,) = gh.gpu_health("n1", fake_nvml({}, init_error="Driver Not Loaded"))
    assert r.status == "UNKNOWN" and "Driver Not Loaded" in r.message and r.value is None


def test_no_gpu_is_unknown():
    (r,) = gh.gpu_health("n1", fake_nvml())
    assert r.status == "UNKNOWN" and "no GPU" in r.message


def test_missing_binding_is_unknown(monkeypatch):
    def no_pynvml(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(gh.importlib, "import_module", no_pynvml)
    (r,) = gh.gpu_health("n1")
    assert r.status == "UNKNOWN" and "nvidia-ml-py" in r.message


def test_in_a_container_pid_namespace_the_job_is_not_a_leftover(monkeypatch):
    """NVML reports host process ids (NVIDIA/nvidia-docker#1483): inside a container none of
    them is one of this job's, although this process holds a context. Every healthy node would
    be CRITICAL; the leftover check is said to be skipped instead. The other checks still
    judge, and outside a namespace (our own id listed) a stranger is still CRITICAL."""
    import os
    import sys

    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(
        cuda=SimpleNamespace(is_initialized=lambda: True)))
    host_ids = [SimpleNamespace(pid=900001, usedGpuMemory=1 << 30)]
    ok, bad = gh.gpu_health("n1", fake_nvml({"ComputeRunningProcesses": host_ids},
                                            {"ComputeRunningProcesses": host_ids,
                                             "TotalEccErrors": 1}))
    assert ok.status == "OK" and "leftover processes not checked" in ok.message
    assert bad.status == "CRITICAL" and "uncorrected ECC" in bad.message
    assert "skipped" in ok.evidence["leftover_check"]
    mine = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=1 << 30)]
    r, = gh.gpu_health("n1", fake_nvml({"ComputeRunningProcesses": mine + host_ids}))
    assert r.status == "CRITICAL" and "leftover" in r.message
