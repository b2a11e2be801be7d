"""Who am I in this job? Reads the launcher's environment: torchrun, srun, or mscale --local.

The engine never asks the launcher for anything else, so one code path serves all three.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from mscale.errors import MscaleError
from mscale.hostlist import expand_hostlist

if TYPE_CHECKING:
    from mscale.config.plan import Plan


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job, as the launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """``torchrun``, ``slurm`` or ``local``."""
    hostname: str
    """This node's name as the launcher knows it."""
    restart_count: int = 0
    """How many times the launcher has restarted the job (SLURM/torchelastic)."""
    step_layout_problem: str | None = None
    """Why the launcher's placement of the whole step cannot be the plan's, when every rank can
    tell alike (srun: unequal tasks per node, a cyclic distribution): every rank then refuses at
    once, not only those it put on the wrong node while the others wait out the timeout."""


def slurm_master_port(job_id: str) -> int:
    """A port derived from the job id, so concurrent jobs on shared nodes do not collide."""
    return 20000 + int(job_id) % 20000 if job_id.isdigit() else 29500


class NoLauncherError(MscaleError):
    """Not started by a launcher: no rank, no world, nothing to join. Its own type so that a
    process's edge can tell "there is no job" (a plain usage error) from a failure in one."""


def no_launcher_fix(command: str | None = None, world: int | None = None) -> str:
    """The fix for a command started without a launcher. It names the command that is running:
    this helper is shared by every job-style command (train, preflight), so a fixed text would
    send the user of one to another. ``world`` (the plan's process count) fills in ``--local``."""
    n = str(world) if world else "N"
    if not command:
        return (f"run it under srun or torchrun ({n} processes); `mscale train` and `mscale "
                f"preflight` also run on this machine with --local {n}")
    return (f"run it under srun or torchrun ({n} processes), or on this machine with "
            f"`mscale {command} PLAN --run-dir DIR --local {n}`")


def read_launch_env(env: Mapping[str, str] | None = None, command: str | None = None,
                    world: int | None = None) -> LaunchEnv:
    """Build a LaunchEnv from torchrun variables (RANK, WORLD_SIZE, …) or SLURM ones.

    torchrun wins when both are present: ``srun torchrun …`` sets both, and torchrun's view is
    the per-process one. Without either, `NoLauncherError`, whose fix names ``command`` (the
    subcommand running, e.g. ``"preflight"``) and ``world`` (see `no_launcher_fix`).
    """
    env = os.environ if env is None else env
    host = env.get("SLURMD_NODENAME") or os.uname().nodename
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher=env.get("MSCALE_LAUNCHER", "torchrun"), hostname=host,
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # the step's nodes, not the allocation's: a relaunch that excludes the allocation's first
        # node (srun --exclude inside the job) has its rank 0 elsewhere
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                or env.get("SLURM_NODELIST", host))
        ntasks = int(env["SLURM_NTASKS"])
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", len(nodes)))
        node_id = int(env.get("SLURM_NODEID", 0))
        counts = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                      or env.get("SLURM_TASKS_PER_NODE", ""))
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        if 0 <= node_id < len(counts):
            local_world = counts[node_id]
        else:
            local_world = int(per_node) if per_node.isdigit() else max(1, ntasks // max(1, nnodes))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]), world_size=ntasks,
            local_rank=int(env.get("SLURM_LOCALID", 0)), local_world_size=local_world,
            node_rank=node_id,
            master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=int(env.get("MASTER_PORT", slurm_master_port(env.get("SLURM_JOB_ID", "")))),
            launcher="slurm", hostname=host,
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
            step_layout_problem=_slurm_step_problem(counts, env.get("SLURM_DISTRIBUTION", "")))
    raise NoLauncherError("no launcher environment found (neither RANK/WORLD_SIZE nor "
                          "SLURM_PROCID are set)", fix=no_launcher_fix(command, world))


def slurm_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks per node (``2(x3),1``: 2, 2, 2, 1) as a list; [] if unreadable."""
    out: list[int] = []
    for part in spec.split(",") if spec else []:
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm_step_problem(counts: list[int], distribution: str) -> str | None:
    """What every task of the step sees alike that no plan's placement allows (a plan puts
    gpus_per_node consecutive ranks on each node)."""
    if len(set(counts)) > 1:
        return (f"the step runs {','.join(map(str, counts))} tasks on its {len(counts)} nodes "
                "(SLURM_STEP_TASKS_PER_NODE): a plan puts the same number on every node")
    nodes_way = distribution.split(":")[0].split(",")[0].strip().lower()
    # One task a node is laid out alike by every distribution; srun then says cyclic (its
    # default when tasks do not outnumber nodes), as in a `--ntasks-per-node=1` batch job.
    if counts and max(counts) == 1:
        return None
    if nodes_way and nodes_way not in ("block", "*"):
        return (f"srun's distribution is {distribution} (SLURM_DISTRIBUTION): ranks are not "
                "laid out node by node as the plan places them")
    return None


def node_name(env: LaunchEnv, plan: "Plan") -> str:
    """This process's node as the job's records name it: the plan's node name under ``--local``
    (every pretend node is this machine, and its launcher, watch and recover all say ``node3``),
    else the launcher's (SLURM's node name, or the host name under torchrun). Console lines,
    error files and events use it so that one node has one name everywhere."""
    if env.launcher == "local":
        from mscale.topology.placement import placement_for  # same package; placement is heavier

        names = plan.cluster.node_names()
        index = placement_for(plan).node(env.rank)
        if 0 <= index < len(names):
            return names[index]
    return env.hostname


def check_node_matches(plan: "Plan", env: LaunchEnv) -> None:
    """Refuse to run when the launcher put this rank on a different node than the plan says:
    TP groups would then cross nodes and every step would crawl over the NICs. Train and
    preflight both ask it of every rank before the rendezvous (preflight must test the links
    the job will use: the same launch line train refuses would have it test others)."""
    from mscale.topology.placement import placement_for  # same package; placement is heavier

    placement = placement_for(plan)
    if env.step_layout_problem:  # every rank sees it: all refuse now, none waits for the rest
        raise MscaleError(env.step_layout_problem, field="placement",
                          fix=f"srun -N {plan.cluster.nodes} --ntasks-per-node "
                              f"{plan.cluster.gpus_per_node} (block distribution, SLURM's "
                              "default)")
    if env.world_size != placement.world:
        raise MscaleError(f"the launcher started {env.world_size} processes but the plan needs "
                          f"{placement.world}", field="layout",
                          fix=f"launch exactly {placement.world} processes (e.g. --local "
                              f"{placement.world}, srun -n {placement.world}, or torchrun "
                              "--nnodes × --nproc-per-node making as many)")
    if env.local_world_size != plan.cluster.gpus_per_node and env.launcher != "torchrun":
        raise MscaleError(f"{env.local_world_size} processes per node, plan says "
                          f"{plan.cluster.gpus_per_node}", field="cluster.gpus_per_node",
                          fix="launch gpus_per_node processes per node (srun --ntasks-per-node)")
    if placement.node(env.rank) != env.node_rank:
        raise MscaleError(f"rank {env.rank} runs on node index {env.node_rank} but the plan "
                          f"places it on node {placement.node(env.rank)}", field="placement",
                          fix="launch ranks in node order (srun block distribution; torchrun "
                              f"--nproc-per-node {plan.cluster.gpus_per_node}, the plan's "
                              "gpus_per_node, with --node-rank matching the plan)")
