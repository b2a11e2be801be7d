"""GPU health through NVML: what a GEMM benchmark alone does not show yet, or shows too late.

One result per GPU of the node. NVML is the NVIDIA driver's management library; its Python
binding (``pynvml``, from the ``nvidia-ml-py`` package) is imported lazily so that CPU machines
need neither. Without it, or without a driver, the check is UNKNOWN with the reason — never OK,
since nothing was checked. Tests pass a fixture module object with the same functions.

What is judged (NVML API reference, "Device Queries"; thresholds in docs/preflight.md):
- volatile uncorrected ECC errors since the driver loaded → CRITICAL (data may be corrupt);
- row remapping: a failed remap → CRITICAL; a pending one (applied at the next GPU reset) →
  WARNING;
- clock event (throttle) reasons now: hardware slowdown, hardware thermal slowdown or power
  brake → CRITICAL (clocks are cut hard: the GPU becomes the job's straggler); software thermal
  slowdown → WARNING; power cap, idle and application clocks are normal;
- PCIe link width below the GPU's maximum → CRITICAL (a lane-degraded slot); a link generation
  below the node's other GPUs while busy → WARNING (idle GPUs lower the generation to save power,
  and a host may cap it for every GPU alike, so only the odd one out is suspect);
- compute processes that are not this job's, holding the GPU → CRITICAL (a leftover of an earlier
  job: it holds memory the run will need and competes for the GPU).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Collection
from typing import Any, Callable

from mscale.config.preflight import STATUS_CODE, CheckResult, Status

# clock event reason bits (nvml.h, nvmlClocksEventReason*)
IDLE = 0x1
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
CRITICAL_REASONS = {HW_SLOWDOWN: "hardware slowdown", HW_THERMAL: "hardware thermal slowdown",
                    HW_POWER_BRAKE: "hardware power brake"}
MEMORY_ERROR_TYPE_UNCORRECTED = 1
VOLATILE_ECC = 0


def load_nvml() -> tuple[Any | None, str]:
    """The ``pynvml`` module, or None and why not."""
    try:
        return importlib.import_module("pynvml"), ""
    except ImportError:
        return None, "the NVML binding is not installed (pip install nvidia-ml-py)"


def gpu_health(node: str, nvml: Any | None = None,
               ignore_pids: Collection[int] = ()) -> list[CheckResult]:
    """One ``gpu_health`` result per GPU NVML sees on this node; UNKNOWN when NVML cannot run.

    ``ignore_pids``: this job's own processes on the node (preflight's ranks hold a context on
    their GPU); this process is always ignored.
    """
    reason = ""
    if nvml is None:
        nvml, reason = load_nvml()
    if nvml is None:
        return [_unknown(node, reason)]
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error as e:
        return [_unknown(node, f"NVML could not start ({e}): no NVIDIA driver on this node?")]
    try:
        count = nvml.nvmlDeviceGetCount()
        if not count:
            return [_unknown(node, "NVML sees no GPU on this node")]
        gpus = [_query(nvml, error, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    except error as e:
        return [_unknown(node, f"NVML failed while reading the GPUs ({e})")]
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass
    top_gen = max((g["pcie_gen"] for g in gpus if g.get("pcie_gen") is not None), default=None)
    ours = set(ignore_pids) | {os.getpid()}
    if _other_pid_namespace(gpus, ours):
        ours = None
    return [_judge(node, i, g, top_gen, ours) for i, g in enumerate(gpus)]


def _other_pid_namespace(gpus: list[dict[str, Any]], ours: set[int]) -> bool:
    """True when NVML's process ids are not this PID namespace's: this process holds a CUDA
    context, so NVML lists it, yet none of the ids it lists is ours. NVML reports host ids, so
    inside a container with its own PID namespace (Docker, Kubernetes) every rank of this job
    would look like a leftover process (NVIDIA/nvidia-docker#1483): the leftover check is then
    not possible, and is said to be skipped rather than failing every healthy node."""
    torch = sys.modules.get("torch")  # preflight's ranks imported it; never imported here
    try:
        held = torch is not None and torch.cuda.is_initialized()
    except Exception:  # noqa: BLE001 - a broken CUDA runtime: no evidence either way
        held = False
    listed = {getattr(p, "pid", None) for g in gpus for p in g["processes"]}
    return held and bool(listed) and not listed & ours


def _query(nvml: Any, error: type, h: Any) -> dict[str, Any]:
    """Everything judged, read once; a query the GPU does not support is left out (None)."""
    def ask(fn: str, *args: Any) -> Any:
        f: Callable | None = getattr(nvml, fn, None)
        if f is None:
            return None
        try:
            return f(h, *args)
        except error:
            return None

    reasons = ask("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:  # the name before NVML 12.2
        reasons = ask("nvmlDeviceGetCurrentClocksThrottleReasons")
    return {"ecc_uncorrected": ask("nvmlDeviceGetTotalEccErrors", MEMORY_ERROR_TYPE_UNCORRECTED,
                                   VOLATILE_ECC),
            "remapped_rows": ask("nvmlDeviceGetRemappedRows"),
            "clock_reasons": reasons,
            "pcie_gen": ask("nvmlDeviceGetCurrPcieLinkGeneration"),
            "pcie_width": ask("nvmlDeviceGetCurrPcieLinkWidth"),
            "pcie_max_width": ask("nvmlDeviceGetMaxPcieLinkWidth"),
            "processes": ask("nvmlDeviceGetComputeRunningProcesses") or []}


def _judge(node: str, index: int, g: dict[str, Any], top_gen: int | None,
           ours: set[int] | None) -> CheckResult:
    """``ours``: this job's process ids; None when NVML's ids cannot be compared with them."""
    findings: list[tuple[Status, str]] = []
    if g["ecc_uncorrected"]:
        findings.append(("CRITICAL", f"{g['ecc_uncorrected']} uncorrected ECC errors"))
    rows = g["remapped_rows"]
    if rows is not None:
        _corr, _unc, pending, failed = rows
        if failed:
            findings.append(("CRITICAL", "a row remapping failed: the GPU needs replacing"))
        elif pending:
            findings.append(("WARNING", "a row remapping is pending: reset the GPU"))
    reasons = g["clock_reasons"] or 0
    for bit, name in CRITICAL_REASONS.items():
        if reasons & bit:
            findings.append(("CRITICAL", f"clocks cut by {name}"))
    if reasons & SW_THERMAL:
        findings.append(("WARNING", "clocks cut by software thermal slowdown"))
    width, max_width = g["pcie_width"], g["pcie_max_width"]
    if width is not None and max_width and width < max_width:
        findings.append(("CRITICAL", f"PCIe link at x{width} of x{max_width}"))
    gen = g["pcie_gen"]
    if gen is not None and top_gen and gen < top_gen and not reasons & IDLE:
        findings.append(("WARNING", f"PCIe gen {gen} while the node's other GPUs run gen "
                         f"{top_gen}"))
    foreign = [] if ours is None else [p for p in g["processes"]
                                       if getattr(p, "pid", None) not in ours]
    if foreign:
        held = sum(getattr(p, "usedGpuMemory", 0) or 0 for p in foreign)
        findings.append(("CRITICAL", f"{len(foreign)} leftover process(es) "
                         f"(pid {', '.join(str(p.pid) for p in foreign[:5])}) hold "
                         f"{held / 2**30:.1f} GiB: stop them or drain the node"))
    status = max((s for s, _ in findings), key=STATUS_CODE.__getitem__, default="OK")
    evidence = {k: v for k, v in g.items() if k != "processes"}
    evidence["foreign_pids"] = [p.pid for p in foreign]
    if ours is None:
        evidence["leftover_check"] = ("skipped: NVML reports host process ids, which this PID "
                                      "namespace (a container) cannot match with its own")
    return CheckResult(check="gpu_health", entity_kind="node", entity=f"{node}:gpu{index}",
                       node=node, value=float(len(findings)), unit="problems",
                       expected="0 uncorrected ECC, no failed remap, no hardware slowdown, "
                                "full PCIe width, no leftover process",
                       status=status, message=("; ".join(m for _, m in findings) or "healthy")
                       + ("" if ours is not None else " (leftover processes not checked: NVML's "
                          "process ids are the host's, not this container's)"),
                       evidence=_plain(evidence))


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    """NVML returns tuples and ctypes-backed ints; keep JSON-friendly values."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _unknown(node: str, reason: str) -> CheckResult:
    return CheckResult(check="gpu_health", entity_kind="node", entity=node, node=node,
                       status="UNKNOWN", expected="NVML answers",
                       message=f"GPU health not checked: {reason}")
