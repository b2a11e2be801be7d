import itertools

import pytest

from mscale.errors import MscaleError
from mscale.topology.env import read_launch_env
from mscale.hostlist import collect_hostlist, expand_hostlist
from mscale.topology.placement import Placement

LAYOUTS = [(1, 1, 1, 1), (2, 2, 2, 2), (8, 8, 4, 8), (4, 2, 8, 8), (2, 4, 3, 8), (1, 3, 5, 1)]


@pytest.mark.parametrize("tp,pp,dp,gpn", LAYOUTS)
def test_groups_partition_the_world(tp, pp, dp, gpn):
    p = Placement(tp=tp, pp=pp, dp=dp, gpus_per_node=gpn)
    for groups, size in ((p.tp_groups, tp), (p.pp_groups, pp), (p.dp_groups, dp)):
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(p.world))  # every rank exactly once
        assert all(len(g) == size for g in groups)
    for r in range(p.world):
        c = p.coord(r)
        assert p.rank(c.dp, c.pp, c.tp) == r
    # TP never crosses a node
    assert all(len({p.node(r) for r in g}) == 1 for g in p.tp_groups)
    # members of a PP group share dp and tp, differ in pp (stage order)
    for g in p.pp_groups:
        assert [p.coord(r).pp for r in g] == list(range(pp))


def test_dp_groups_are_contiguous_nodes():
    p = Placement(tp=8, pp=8, dp=4, gpus_per_node=8)
    for g in p.dp_groups:
        nodes = [p.node(r) for r in g]
        assert nodes == list(range(nodes[0], nodes[0] + 4))


def test_dp_hierarchy_splits_by_node():
    p = Placement(tp=2, pp=1, dp=8, gpus_per_node=8)  # 4 DP ranks per node, 2 nodes
    intra, inter = p.dp_hierarchy(p.dp_groups[0])
    assert intra == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert inter == [[0, 8], [2, 10], [4, 12], [6, 14]]


def test_tp_larger_than_node_refused():
    with pytest.raises(MscaleError, match="tp=16"):
        Placement(tp=16, pp=1, dp=1, gpus_per_node=8)


def test_hostlist_roundtrip():
    hosts = expand_hostlist("node[001-004,007]")
    assert hosts == ["node001", "node002", "node003", "node004", "node007"]
    assert collect_hostlist(hosts) == "node[001-004,007]"
    with pytest.raises(ValueError):
        expand_hostlist("node[1-")


def test_launch_env_slurm_and_torchrun():
    slurm = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                             "SLURM_NODEID": "2", "SLURM_NNODES": "4",
                             "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_JOB_ID": "77",
                             "SLURMD_NODENAME": "node3"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.node_rank) == (5, 8, 1, 2)
    assert slurm.local_world_size == 2 and slurm.master_addr == "node1"
    assert slurm.master_port == 20077 and slurm.hostname == "node3"
    tr = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                          "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1234", "SLURM_PROCID": "0",
                          "SLURM_NTASKS": "2"})
    assert (tr.rank, tr.launcher, tr.master_port) == (3, "torchrun", 1234)
    with pytest.raises(MscaleError):
        read_launch_env({})
