"""Where does the launcher put this process, and is that where the plan expects it?

Run under any launcher: ``srun … python -m mscale.topology.probe PLAN.yaml`` (or torchrun). Each
process prints ONE JSON line: its launcher view (rank, world size, local rank, node rank, host
name, launcher, master address/port), its plan coordinate (dp, pp, tp), the plan's node name for
its rank, whether the two node names agree, and ``launch_problem``: why train and preflight would
refuse this launch (tasks per node, an uneven step, a cyclic distribution), or null. `mscale
train` makes the same check at start-up; this module exists so that the SLURM/torchrun path can
be tested on its own, with no training (tests/e2e/test_slurm.py), and so an operator can dry-run
a launch line on a real allocation.
"""

from __future__ import annotations

import json
import sys

from mscale.topology.env import LaunchEnv, check_node_matches, read_launch_env
from mscale.topology.placement import load_checked_plan, placement_for


def probe(plan_path: str, env: LaunchEnv | None = None) -> dict:
    """The record one process prints; see the module docstring."""
    env = env or read_launch_env()
    plan = load_checked_plan(plan_path)
    place = placement_for(plan)
    if env.world_size != place.world:
        from mscale.errors import MscaleError

        raise MscaleError(f"launcher started {env.world_size} processes, the plan needs "
                          f"{place.world} (tp·pp·dp)", file=plan_path, field="layout",
                          fix=f"launch {place.world} processes, e.g. srun -n {place.world}")
    c = place.coord(env.rank)
    plan_node = plan.cluster.node_names()[place.node(env.rank)]
    return {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
            "node_rank": env.node_rank, "hostname": env.hostname, "launcher": env.launcher,
            "master_addr": env.master_addr, "master_port": env.master_port,
            "dp": c.dp, "pp": c.pp, "tp": c.tp, "plan_node": plan_node,
            "node_match": env.hostname == plan_node, "launch_problem": _launch_problem(plan, env)}


def _launch_problem(plan, env: LaunchEnv) -> str | None:
    """Why `train` and `preflight` would refuse this rank's launch (`check_node_matches`), or
    None. A dry run that printed rank 0 of an uneven step (``srun -N 3 -n 8``) as placed where
    the plan says, ``node_match`` true, passed a line every rank of the job then refused."""
    from mscale.errors import MscaleError

    try:
        check_node_matches(plan, env)
    except MscaleError as e:
        return f"{e.message}; fix: {e.fix}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mscale.topology.probe PLAN.yaml", file=sys.stderr)
        return 3
    from mscale.errors import MscaleError

    try:
        record = probe(args[0])
    except MscaleError as e:
        print(f"mscale probe: {e}", file=sys.stderr)
        return e.code
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
