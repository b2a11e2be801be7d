"""Offline resharding over a grid of layouts: every tensor comes back bit for bit, and each
converted checkpoint holds exactly the slices a live rank of its layout would write."""

from __future__ import annotations

import pytest
import torch

from mscale.ckpt import catalog
from mscale.ckpt.convert import reshard
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.ownership import for_plan, write_items
from mscale.ckpt.verify import verify
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic

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
        native = {r: [(it.key, it.box, it.flat) for it in write_items(for_plan(p, r))]
                  for r in range(p.layout.world_size)}
        written = {s.rank: [(x.tensor, x.box_tuple(), tuple(x.flat)) for x in s.slices]
                   for s in m.shards}
        assert written == native
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
