"""Offline resharding over a grid of layouts: every tensor comes back bit for bit, every slice
holds the bytes of the region it claims, and each rank's slices are the ones the ownership rules
give, worked out by hand here (not by the code convert calls). That the plan-only layout is the
live engine's is tests/distributed/test_ckpt_layout.py; that a converted checkpoint equals the live
engine's own save at the target layout is tests/distributed/test_ckpt_reshard.py."""

from __future__ import annotations

import pytest
import torch

from mscale.ckpt import catalog, files
from mscale.ckpt.convert import reshard
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.ownership import for_plan, write_items
from mscale.ckpt.verify import verify
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic

ONE_BUCKET_EACH = 1e-6
"""``bucket_mb`` under one gradient element: every parameter closes its own bucket, so a ZeRO
shard is the same run of every parameter and the slices can be stated by hand."""

CHAIN = [
    dict(tp=1, pp=1, dp=1),
    dict(tp=1, pp=2, dp=4),
    dict(tp=4, pp=1, dp=2),
    dict(tp=2, pp=1, dp=4, zero=2),
    dict(tp=2, pp=2, dp=2, zero=0),
    dict(tp=1, pp=1, dp=8, zero=1, hier=True),
    dict(tp=2, pp=2, dp=2),
]


def _read_all(path):
    m = catalog.load_committed(path)
    with CheckpointReader(path, m) as r:
        return {k: r.read_full(k) for k in m.tensors}, m


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_chain_of_layouts_is_exact(tmp_path, proto):
    base = str(tmp_path) if proto == "file" else f"memory://chain{id(tmp_path)}"
    start = plan(tp=2, pp=2, dp=2)
    tensors = global_state(start)
    src = f"{base}/a/ckpt/step-000005"
    write_synthetic(src, start, tensors)
    for i, layout in enumerate(CHAIN):
        p = plan(**layout)
        dst = f"{base}/c{i}"
        reshard(src, catalog.load_committed(src), dst, p, level=i % 2)
        assert verify(dst).problems == []
        got, m = _read_all(dst)
        assert m.layout["world"] == p.layout.world_size and m.state.step == 5
        assert sorted(got) == sorted(tensors)
        for k, v in tensors.items():
            assert torch.equal(got[k], v), (layout, k)
        _slices_hold_their_regions(dst, m, tensors)
        assert m.model_alias == "optim.master" and not any(k.startswith("model/") for k in got)
        with CheckpointReader(dst, m) as r:  # parameters are served by their master weights
            name = "layers.1.attn.wq.weight"
            assert torch.equal(r.read_full(f"model/{name}"), tensors[f"optim.master/{name}"])
        src = dst


def test_every_element_written_once_and_spread_over_ranks():
    p = plan(tp=2, pp=1, dp=4, zero=1)
    per_rank = [sum(it.count for it in write_items(for_plan(p, r))) for r in range(8)]
    total = sum(v.numel() for v in global_state(p).values())
    assert sum(per_rank) == total
    assert max(per_rank) < 1.35 * min(per_rank)  # the DP replicas split the model


def _slices_hold_their_regions(path, m, tensors) -> None:
    """Each saved slice, read alone, is ``global[box].flatten()[lo:hi]`` of the source tensor
    (cut here by plain indexing, not by the reader's assembly)."""
    with CheckpointReader(path, m) as r:
        for shard in m.shards:
            for x in files.shard_slices(path, m, shard):
                box, (lo, hi) = x.box_tuple(), x.flat
                want = tensors[x.tensor][tuple(slice(a, b) for a, b in box)].reshape(-1)[lo:hi]
                assert torch.equal(r.read(x.tensor, box, (lo, hi)), want), (shard.path, x.tensor)


def _tp_dim(name: str) -> int | None:
    """Megatron's split, by hand: norms replicated, the output and down projections split
    along their input (row-parallel), everything else along its output rows."""
    if "norm" in name:
        return None
    return 1 if name.endswith(("attn.wo.weight", "mlp.down.weight")) else 0


def _by_hand(tensors: dict, tp: int, dp: int, shard) -> dict[int, set]:
    """Per rank (tp fastest, then dp; pp 1) the optimizer slices it writes with one bucket per
    parameter: its TP box (replicated tensors by TP rank 0 only) and, of the box's m elements,
    the run ``[s*c, min(m, (s+1)*c))`` with ``c = ceil(m/dp)`` and ``s = shard(rank)``."""
    out = {}
    for r in range(tp * dp):
        t, s = r % tp, shard(r)
        want = set()
        for key, full in tensors.items():
            dim = _tp_dim(key.split("/", 1)[1])
            if dim is None and t:
                continue
            box = [(0, n) for n in full.shape]
            if dim is not None:
                n = full.shape[dim] // tp
                box[dim] = (t * n, (t + 1) * n)
            m = 1
            for a, b in box:
                m *= b - a
            c = -(-m // dp)
            if s * c < m:
                want.add((key, tuple(box), (s * c, min(m, (s + 1) * c))))
        out[r] = want
    return out


HAND = {
    "flat-dp8": (dict(tp=1, dp=8), lambda r: r),
    # 4 nodes of 2: the rank at position i on node j ends up with shard 4i+j (the node-local
    # reduce-scatter first, then the cross-node one)
    "hierarchical-dp8": (dict(tp=1, dp=8, hier=True), lambda r: (r % 2) * 4 + r // 2),
    "tp2-dp2": (dict(tp=2, dp=2), lambda r: r // 2),
}


@pytest.mark.parametrize("case", sorted(HAND))
def test_converted_slices_are_the_ones_worked_out_by_hand(tmp_path, case):
    layout, shard = HAND[case]
    start = plan(tp=2, pp=2, dp=2)
    tensors = global_state(start)
    src = f"{tmp_path}/a/ckpt/step-000005"
    write_synthetic(src, start, tensors)
    target = plan(**layout, bucket_mb=ONE_BUCKET_EACH)
    m = reshard(src, catalog.load_committed(src), f"{tmp_path}/b", target, level=0)
    written = {s.rank: {(x.tensor, x.box_tuple(), tuple(x.flat))
                        for x in files.shard_slices(f"{tmp_path}/b", m, s)} for s in m.shards}
    assert written == _by_hand(tensors, layout["tp"], layout["dp"], shard)
    _slices_hold_their_regions(f"{tmp_path}/b", m, tensors)
