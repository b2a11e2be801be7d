"""The harness itself and process-group construction from a placement."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist


def _groups(rank, world, hierarchical):
    from datetime import timedelta

    from mscale.distributed.groups import build_groups
    from mscale.topology.placement import Placement

    pl = Placement(tp=2, pp=1, dp=world // 2, gpus_per_node=4)
    g = build_groups(pl, rank, timedelta(seconds=30), hierarchical_dp=hierarchical)
    out = {}
    for name, grp in (("tp", g.tp_group), ("dp", g.dp_group), ("intra", g.dp_intra_group),
                      ("inter", g.dp_inter_group)):
        if grp is None:
            continue
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=grp)
        out[name] = x.item()
    return out


def test_groups_reduce_over_the_right_members():
    res = run_distributed(_groups, 8, True)
    # tp pairs (0,1),(2,3)...; dp groups {0,2,4,6},{1,3,5,7}; nodes of 4: intra {0,2},{4,6}
    assert [r["tp"] for r in res] == [1, 1, 5, 5, 9, 9, 13, 13]
    assert [r["dp"] for r in res] == [12, 16, 12, 16, 12, 16, 12, 16]
    assert [r["intra"] for r in res] == [2, 4, 2, 4, 10, 12, 10, 12]
    assert [r["inter"] for r in res] == [4, 6, 8, 10, 4, 6, 8, 10]


def _raise(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a peer that is gone: must time out, not hang


def test_child_failure_is_reported_fast():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_raise, 2, timeout_s=5)
