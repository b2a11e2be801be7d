"""Environment variables known to hurt a training job, judged on each node.

A variable left in a node's environment (a module file, a debugging session's export, an image
default) can quietly route a job's traffic over TCP or serialise every kernel, and only on that
node. Each rule below names the variable, the values that hurt, the status and why, from the
NCCL and PyTorch documentation (NCCL "Environment Variables"; PyTorch "torch.distributed",
"ProcessGroupNCCL environment variables"). NCCL and CUDA rules apply only when the plan runs on
GPUs; gloo runs never read them. Clock skew across nodes needs a collective and is judged by
the network side of preflight, not here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Callable

from mscale.config.preflight import CheckResult, Status


@dataclass(frozen=True)
class Rule:
    """One variable: when its value hurts, how much, and why."""

    var: str
    hurts: Callable[[str], bool]
    status: Status
    why: str
    gpu_only: bool = True


def _truthy(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


def _int_below(limit: int) -> Callable[[str], bool]:
    return lambda v: v.strip().isdigit() and int(v) < limit


RULES: tuple[Rule, ...] = (
    Rule("NCCL_IB_DISABLE", _truthy, "CRITICAL",
         "NCCL stops using InfiniBand/RoCE and falls back to TCP sockets between nodes"),
    Rule("NCCL_P2P_DISABLE", _truthy, "CRITICAL",
         "NCCL stops using NVLink/PCIe peer-to-peer inside the node; tensor-parallel traffic "
         "goes through host memory"),
    Rule("NCCL_SHM_DISABLE", _truthy, "WARNING",
         "NCCL stops using shared memory between processes of the node"),
    Rule("NCCL_NET_GDR_LEVEL", lambda v: v.strip().upper() in ("0", "LOC"), "WARNING",
         "GPUDirect RDMA is never used: every inter-node transfer is staged through host memory"),
    Rule("NCCL_ALGO", bool, "WARNING",
         "forces NCCL's algorithm choice instead of its tuner; NCCL documents it for debugging"),
    Rule("NCCL_PROTO", bool, "WARNING",
         "forces NCCL's protocols; NCCL discourages setting it except to work around a bug"),
    Rule("NCCL_MAX_NCHANNELS", _int_below(4), "WARNING",
         "caps NCCL at fewer than 4 channels, so collectives cannot reach the link bandwidth"),
    Rule("NCCL_DEBUG", lambda v: v.strip().upper() == "TRACE", "WARNING",
         "TRACE logs a replayable line for every NCCL call"),
    Rule("CUDA_LAUNCH_BLOCKING", _truthy, "WARNING",
         "every CUDA kernel launch waits for the kernel to finish: no overlap of compute and "
         "communication"),
    Rule("TORCH_NCCL_ASYNC_ERROR_HANDLING", lambda v: v.strip() == "0", "WARNING",
         "a failed NCCL collective no longer aborts the job: a dead peer hangs it instead"),
    Rule("TORCH_DISTRIBUTED_DEBUG", lambda v: v.strip().upper() == "DETAIL", "WARNING",
         "every collective is checked against the other ranks' with an extra collective",
         gpu_only=False),
)


def environment_checks(node: str, env: Mapping[str, str], *, gpu: bool,
                       ib_devices: Collection[str] = ()) -> list[CheckResult]:
    """One ``nccl_env`` result per variable that hurts; one OK result when none does.

    ``ib_devices``: the node's InfiniBand/RoCE device names (from sysfs), to check that
    ``NCCL_IB_HCA`` names devices that exist.
    """
    out = [_result(node, r.var, env[r.var], r.status, r.why) for r in RULES
           if r.var in env and (gpu or not r.gpu_only) and r.hurts(env[r.var])]
    hca = env.get("NCCL_IB_HCA")
    if gpu and hca and ib_devices:
        out += _hca_findings(node, hca, set(ib_devices))
    if out:
        return out
    seen = {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    return [CheckResult(check="nccl_env", entity_kind="node", entity=node, node=node,
                        status="OK", expected="no variable known to hurt",
                        message="no variable known to hurt", evidence={"set": seen})]


def _hca_findings(node: str, value: str, devices: set[str]) -> list[CheckResult]:
    """``NCCL_IB_HCA`` (``[^|=]dev[:port],...``): a list that matches none of the node's devices
    leaves NCCL without an HCA (CRITICAL); one that names some missing devices, WARNING. An
    exclusion list (``^``) cannot be wrong this way."""
    text = value.strip()
    if text.startswith("^"):
        return []
    names = [p.split(":")[0].strip() for p in text.lstrip("=").split(",") if p.strip()]
    exact = text.startswith("=")
    missing = [n for n in names
               if not any(d == n or (not exact and d.startswith(n)) for d in devices)]
    if not missing:
        return []
    status: Status = "CRITICAL" if len(missing) == len(names) else "WARNING"
    why = (f"names {', '.join(missing)}, which this node does not have "
           f"(it has {', '.join(sorted(devices))})")
    return [_result(node, "NCCL_IB_HCA", value, status, why)]


def _result(node: str, var: str, value: str, status: Status, why: str) -> CheckResult:
    return CheckResult(check="nccl_env", entity_kind="node", entity=f"{node}:{var}", node=node,
                       status=status, expected=f"{var} unset or harmless",
                       message=f"{var}={value}: {why}; unset it in the job's environment",
                       evidence={"var": var, "value": value})
