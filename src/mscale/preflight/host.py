"""Host-level checks of one node: GPUs (NVML), InfiniBand/RoCE ports, storage, environment.

The distributed runner calls `node_checks` once per node, on its local rank 0, while the other
nodes do the same; every check here is a pure function of what this node shows (sysfs, NVML,
its environment, what it measures against the checkpoint URL) and returns `CheckResult`s
blamed on this node. `check_inputs` is the bad-input half, called before any rank starts,
so a wrong ``--sysfs-root`` or an unreachable checkpoint URL is exit 3 with nothing written.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Mapping
from typing import Any

from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult
from mscale.preflight.environment import environment_checks
from mscale.preflight.gpu_health import gpu_health
from mscale.preflight.ib_ports import Snapshot, check_sysfs_root, judge_ports, snapshot
from mscale.preflight.report import quarantined
from mscale.preflight.storage import check_storage_url, storage_checks
from mscale.runs.rundir import RunDir


def plan_uses_gpus(plan: Plan) -> bool:
    """Whether the plan's devices are GPUs (NCCL, NVML, RDMA NICs) rather than the ``cpu``
    preset's gloo processes."""
    return plan.cluster.gpu.name.lower() != "cpu"


def checkpoint_url(run_dir: str, storage_url: str | None) -> str:
    """Where checkpoints go: ``storage_url`` if given, else the run directory's ``ckpt/``."""
    return storage_url or RunDir(run_dir).ckpt


def check_inputs(run_dir: str, *, sysfs_root: str = "/sys",
                      storage_url: str | None = None) -> None:
    """Raise MscaleError (exit 3) for a sysfs root that is not a sysfs tree, a run directory's
    ``quarantine.json`` that does not read, or a checkpoint URL that cannot be written; leaves
    nothing behind. The quarantine is read here too, not only by rank 0 at the end: a hand
    edit that broke it failed the job after every measurement, and none was kept."""
    check_sysfs_root(sysfs_root)
    quarantined(run_dir)
    check_storage_url(checkpoint_url(run_dir, storage_url))


def check_inputs_here(run_dir: str, *, sysfs_root: str = "/sys", storage_url: str | None = None,
                      env: Mapping[str, str] | None = None) -> None:
    """`check_inputs` as this process should run it, before any measuring starts: by the
    ``--local`` launcher once (its workers skip it); under srun/torchrun the sysfs tree by every
    rank (each node has its own) and the storage by rank 0 alone (one probe, not one per rank
    racing in the same directory); everything when no launcher started this process. Who this
    process is comes from `mscale.topology.env.read_launch_env`, as for the job itself."""
    from mscale.topology.env import NoLauncherError, read_launch_env

    try:
        launch = read_launch_env(env)
    except NoLauncherError:
        launch = None
    if launch is not None and launch.launcher == "local":  # a --local worker: its launcher checked
        return
    if launch is None or launch.rank == 0:
        check_inputs(run_dir, sysfs_root=sysfs_root, storage_url=storage_url)
    else:
        check_sysfs_root(sysfs_root)


def node_checks(run_dir: str, plan: Plan, *, level: str, sysfs_root: str = "/sys",
                nvml: Any = None, storage_url: str | None = None, node: str | None = None,
                env: Mapping[str, str] | None = None, ib_before: Snapshot | None = None,
                ignore_pids: Collection[int] = (),
                timeout_s: float | None = None) -> list[CheckResult]:
    """Every host check of this node, blamed on ``node`` (default: the host name).

    ``ib_before``: a `mscale.preflight.ib_ports.snapshot` taken before the network tests, so
    the port counters' deltas cover the traffic; without it the window is this call (the
    storage probe). ``nvml``: a pynvml-like module (tests); ``env``: the node's environment
    (default os.environ); ``ignore_pids``: this job's processes on the node, which hold a GPU
    context and are not leftovers; ``timeout_s``: the job's collective timeout, which the
    node's other ranks wait for these checks under (it bounds the storage probe).
    """
    check_sysfs_root(sysfs_root)
    node = node or socket.gethostname()
    before = ib_before or snapshot(sysfs_root)
    gpu = plan_uses_gpus(plan)
    out: list[CheckResult] = []
    if gpu:
        out += gpu_health(node, nvml, ignore_pids=ignore_pids)
    out += environment_checks(node, os.environ if env is None else env, gpu=gpu,
                              ib_devices={p.split("/")[0] for p in before.ports})
    out += storage_checks(checkpoint_url(run_dir, storage_url), plan, node, level=level,
                          timeout_s=timeout_s)
    after = snapshot(sysfs_root)
    if plan.cluster.num_nodes == 1:
        # a one-node job sends nothing over its NICs: one H200 box without InfiniBand was
        # UNKNOWN (exit 3), and with fewer ports up than the nics_per_node default (8),
        # CRITICAL: the only node excluded for links the job never uses
        return out
    if after.ports:
        out += judge_ports(before, after, node, expected_gbps=plan.cluster.nic_gbit_per_s,
                           nics=plan.cluster.nics_per_node)
    elif gpu:
        out.append(CheckResult(
            check="ib_port", entity_kind="node", entity=node, node=node, status="UNKNOWN",
            expected=f"{plan.cluster.nics_per_node} ports at {plan.cluster.nic_gbit_per_s:g} Gb/s",
            message=f"no InfiniBand/RoCE device under {sysfs_root}/class/infiniband: the "
                    "ports were not checked"))
    return out
