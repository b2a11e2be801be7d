"""Rank placement: the one function that maps a global rank to (dp, pp, tp) and a node.

`plan` writes its result into plan.yaml, `preflight` tests exactly these groups, and `train`
builds its process groups from it, so all three agree by construction.

Order "tp-dp-pp" (fastest first), as Megatron-LM and MegaScale do:
- TP neighbours are consecutive ranks, so a TP group sits inside one node (NVLink);
- DP groups come next, so a DP group covers a contiguous run of nodes and stays inside a pod when
  its size divides the pod's (groups tile the ranks from 0, pods too; MegaScale builds DP groups
  before PP groups to keep DP traffic off inter-pod links);
- pipeline stages are outermost: PP carries the least traffic (activations of one micro-batch),
  so it is the dimension that may cross pods.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mscale.config.plan import GroupsRecord, Plan, PlacementRecord, load_plan
from mscale.errors import MscaleError


@dataclass(frozen=True)
class Coord:
    """Where a rank sits in the 3D grid."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Placement:
    """The rank grid of one layout on nodes of ``gpus_per_node`` GPUs."""

    tp: int
    pp: int
    dp: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.world % self.gpus_per_node and self.world > self.gpus_per_node:
            raise MscaleError(f"world size {self.world} is not a whole number of "
                              f"{self.gpus_per_node}-GPU nodes", field="layout",
                              fix="make tp·pp·dp a multiple of gpus_per_node")
        if self.gpus_per_node % self.tp and self.tp <= self.gpus_per_node:
            raise MscaleError(f"tp={self.tp} does not divide gpus_per_node={self.gpus_per_node}",
                              field="layout.tp", fix="pick tp dividing the GPUs of one node")
        if self.tp > self.gpus_per_node:
            raise MscaleError(f"tp={self.tp} exceeds the {self.gpus_per_node} GPUs of a node",
                              field="layout.tp", fix="tensor parallelism must stay inside a node")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_nodes(self) -> int:
        return max(1, self.world // self.gpus_per_node)

    def coord(self, rank: int) -> Coord:
        """Global rank → (dp, pp, tp)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coord(dp=dp, pp=pp, tp=tp)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """(dp, pp, tp) → global rank; the inverse of `coord`."""
        return tp + self.tp * (dp + self.dp * pp)

    def node(self, rank: int) -> int:
        """Index of the node a rank runs on."""
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """Device index of a rank inside its node."""
        return rank % self.gpus_per_node

    @cached_property
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    @cached_property
    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        """The group in ``groups`` that contains ``rank``."""
        for g in groups:
            if rank in g:
                return g
        raise ValueError(f"rank {rank} in no group")

    def dp_hierarchy(self, dp_group: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Split one DP group for hierarchical reduction.

        Returns (intra, inter): ``intra`` are the members sharing a node (reduce-scatter and
        all-gather run there, on NVLink); ``inter`` are the members holding the same position in
        their node's subgroup (the shard all-reduce runs there, across nodes). Every intra group
        has the same size, so positions line up.
        """
        by_node: dict[int, list[int]] = {}
        for r in dp_group:
            by_node.setdefault(self.node(r), []).append(r)
        intra = list(by_node.values())
        k = len(intra[0])
        if any(len(g) != k for g in intra):  # pragma: no cover - impossible for tp-dp-pp order
            raise ValueError("uneven DP members per node; hierarchical reduction impossible")
        inter = [[g[i] for g in intra] for i in range(k)]
        return intra, inter

    def rows(self) -> list[list[int]]:
        """Rank rows in PlacementRecord column order: rank, node, local_rank, dp, pp, tp."""
        out = []
        for r in range(self.world):
            c = self.coord(r)
            out.append([r, self.node(r), self.local_rank(r), c.dp, c.pp, c.tp])
        return out


def placement_for(plan: Plan) -> Placement:
    """The placement of a plan's layout on its cluster's nodes."""
    return Placement(tp=plan.layout.tp, pp=plan.layout.pp, dp=plan.layout.dp,
                     gpus_per_node=plan.cluster.gpus_per_node)


def placement_record(plan: Plan) -> PlacementRecord:
    """Build the ``placement:`` section of plan.yaml."""
    p = placement_for(plan)
    return PlacementRecord(ranks=p.rows(), nodes=plan.cluster.node_names()[: p.num_nodes],
                           groups=GroupsRecord(tp=p.tp_groups, pp=p.pp_groups, dp=p.dp_groups))


REGENERATE = ("regenerate the plan with `mscale plan`, or delete the placement section to have "
              "it derived")


def check_placement_record(plan: Plan, source: str | None = None) -> None:
    """Refuse a plan whose written rank map, groups or node names differ from the derived ones.

    The names too: preflight and train name nodes from ``cluster.hostlist`` while recover reads
    ``placement.nodes``, so a hostlist edited by hand (a spare swapped in) with the old names
    left below made one node two names: preflight excluded the new one, recover blamed the old.
    """
    assert plan.placement is not None
    expected = placement_record(plan)
    for field in ("ranks", "groups"):
        if getattr(plan.placement, field) != getattr(expected, field):
            raise MscaleError(f"placement.{field} does not match the layout "
                              f"tp={plan.layout.tp} pp={plan.layout.pp} dp={plan.layout.dp}",
                              file=source, field=f"placement.{field}", fix=REGENERATE)
    if plan.placement.nodes != expected.nodes:
        where = ("cluster.hostlist" if plan.cluster.hostlist
                 else "the cluster (no hostlist: generic names)")
        raise MscaleError(f"the written node names ({_few(plan.placement.nodes)}) are not "
                          f"those of {where} ({_few(expected.nodes)})", file=source,
                          field="placement.nodes", fix=REGENERATE)


def _few(names: list[str], shown: int = 3) -> str:
    """The first node names of a list, for a one-line error."""
    return ", ".join(names[:shown]) + (f" ... ({len(names)} in all)" if len(names) > shown else "")


def load_checked_plan(path: str) -> Plan:
    """Load a plan to run or reshard: its layout checked (`load_plan`) and its written rank map,
    when present, equal to the one derived here. Every command that acts on a plan file loads it
    through this function; `load_plan` alone cannot check the map (config sits below topology)."""
    plan = load_plan(path)
    if plan.placement is not None:
        check_placement_record(plan, source=path)
    return plan
