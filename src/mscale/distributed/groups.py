"""Process groups built once from the plan's placement, so every collective knows its peers.

Each group is created with ``use_local_synchronization=True``: only the members of a group take
part in creating it. Without it every rank joins the creation of every group, an O(n²) start-up
that MegaScale measured at ~1,000 s on 2,048 GPUs (docs/references.md); with it start-up is O(n).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from mscale.topology.placement import Coord, Placement


@dataclass
class ParallelGroups:
    """This rank's view of the 3D grid: its coordinate and the groups it belongs to."""

    placement: Placement
    rank: int
    coord: Coord
    tp_ranks: list[int]
    pp_ranks: list[int]
    dp_ranks: list[int]
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_intra_group: dist.ProcessGroup | None = None
    """Members of this rank's DP group on the same node (hierarchical reduction only)."""
    dp_inter_group: dist.ProcessGroup | None = None
    """Members of this rank's DP group at the same position on other nodes (hierarchical only)."""
    dp_intra_ranks: list[int] = field(default_factory=list)
    dp_inter_ranks: list[int] = field(default_factory=list)
    build_seconds: float = 0.0
    """Wall time spent creating the groups (logged at start-up)."""

    @property
    def tp_size(self) -> int:
        return self.placement.tp

    @property
    def pp_size(self) -> int:
        return self.placement.pp

    @property
    def dp_size(self) -> int:
        return self.placement.dp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.placement.pp - 1


def build_groups(placement: Placement, rank: int, timeout: timedelta,
                 hierarchical_dp: bool = False, backend: str | None = None) -> ParallelGroups:
    """Create this rank's TP, PP and DP groups (and DP sub-groups if hierarchical).

    Must be called by every rank after `init_process_group`. Only the groups that contain this
    rank are created here; that is what local synchronization allows.
    """
    t0 = time.perf_counter()
    coord = placement.coord(rank)
    tp = placement.group_of(placement.tp_groups, rank)
    pp = placement.group_of(placement.pp_groups, rank)
    dp = placement.group_of(placement.dp_groups, rank)

    def make(ranks: list[int]) -> dist.ProcessGroup:
        return dist.new_group(ranks, timeout=timeout, backend=backend,
                              use_local_synchronization=True)

    g = ParallelGroups(placement=placement, rank=rank, coord=coord, tp_ranks=tp, pp_ranks=pp,
                       dp_ranks=dp, tp_group=make(tp), pp_group=make(pp), dp_group=make(dp))
    if hierarchical_dp:
        intra, inter = placement.dp_hierarchy(dp)
        g.dp_intra_ranks = next(x for x in intra if rank in x)
        g.dp_inter_ranks = next(x for x in inter if rank in x)
        g.dp_intra_group = make(g.dp_intra_ranks)
        g.dp_inter_group = make(g.dp_inter_ranks)
    g.build_seconds = time.perf_counter() - t0
    return g
