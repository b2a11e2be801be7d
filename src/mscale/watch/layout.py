"""Who is where: each rank's (dp, pp, tp) coordinate and node, as arrays.

From the run's ``plan.yaml`` (the placement `train` used), or from flags for a metrics file
written by another trainer. The rank order is mscale's (tp fastest, then dp, then pp;
topology/placement.py), which is also Megatron-LM's default order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.errors import MscaleError
from mscale.hostlist import expand_hostlist
from mscale.topology.placement import Placement, placement_for


@dataclass(frozen=True)
class JobLayout:
    """The rank grid of a job as arrays indexed by global rank."""

    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    node_names: tuple[str, ...]
    """Name of each node, by node index."""
    stage_layers: tuple[int, ...] | None = None
    """Transformer blocks on each pipeline stage (from the plan, without interleaving), so that
    stage-imbalance advice can name a split that is actually faster (detect/split.py)."""
    micro_batches: int | None = None
    """Micro-batches per step (from the plan), so that a what-if replays the schedule the
    engine ran (replay.py); None: estimated from the bubble."""
    vpp: int = 1
    """Virtual stages per pipeline rank (interleaved 1F1B when > 1)."""
    named: bool = True
    """The node names are the cluster's (a plan's, a ``--hostlist``), fit to quarantine; False
    for the placeholders ``node0``, ``node1``... of flags without a hostlist or of no layout at
    all, which may be real hosts' names: a watch given ``--ranks-per-node 4`` over a plan of 2
    named node1 for a rank on node3, and would have quarantined it."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks(self) -> np.ndarray:
        return np.arange(self.world)

    @property
    def tp_rank(self) -> np.ndarray:
        return self.ranks % self.tp

    @property
    def dp_rank(self) -> np.ndarray:
        return (self.ranks // self.tp) % self.dp

    @property
    def pp_rank(self) -> np.ndarray:
        return self.ranks // (self.tp * self.dp)

    @property
    def node(self) -> np.ndarray:
        """[world] node index of each rank."""
        return self.ranks // self.ranks_per_node

    def node_name(self, rank: int) -> str:
        return self.node_names[int(self.node[rank])]

    @classmethod
    def from_plan(cls, plan) -> "JobLayout":
        p = placement_for(plan)
        names = tuple(plan.cluster.node_names()[: p.num_nodes])
        layers = None
        if p.pp > 1 and plan.layout.vpp == 1:
            layers = tuple(plan.layout.layers_per_stage(plan.model.layers))
        return cls(tp=p.tp, pp=p.pp, dp=p.dp, ranks_per_node=p.gpus_per_node, node_names=names,
                   stage_layers=layers, vpp=plan.layout.vpp,
                   micro_batches=plan.layout.micro_batches(plan.training.global_batch))

    @classmethod
    def from_flags(cls, tp: int, pp: int, dp: int, ranks_per_node: int,
                   hostlist: str | None = None, vpp: int = 1,
                   names: tuple[str, ...] | None = None) -> "JobLayout":
        """``--tp/--pp/--dp/--ranks-per-node [--hostlist]``; ``names``: the plan's node names,
        when the flags leave its nodes as they are (watch/target.py `_with_flags`)."""
        Placement(tp=tp, pp=pp, dp=dp, gpus_per_node=ranks_per_node)  # same refusals as a plan
        nodes = max(1, tp * pp * dp // ranks_per_node)
        named = hostlist is not None or names is not None
        if hostlist:
            names = tuple(expand_hostlist(hostlist))
        elif names is None:
            names = tuple(f"node{i}" for i in range(nodes))
        if len(names) != nodes if hostlist else len(names) < nodes:  # keep no name unplaced
            raise MscaleError(f"the {'hostlist' if hostlist else 'plan'} names {len(names)} "
                              f"nodes, the layout needs {nodes}",
                              field="--hostlist",
                              fix="give one host per node, in rank order" if hostlist else
                                  "give --hostlist with the job's own nodes in rank order")
        return cls(tp=tp, pp=pp, dp=dp, ranks_per_node=ranks_per_node, node_names=names[:nodes],
                   vpp=vpp, named=named)

    @classmethod
    def flat(cls, world: int) -> "JobLayout":
        """No layout known: every rank its own DP replica on one node (rank-level rules only)."""
        return cls(tp=1, pp=1, dp=world, ranks_per_node=world, node_names=("node0",),
                   named=False)
