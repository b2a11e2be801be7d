"""Initial values by global name: stable seeds, the same weights at any split, the init rule."""

import math

import pytest
import torch

from mscale.config.model import ModelConfig
from mscale.model import Transformer, init_weights
from mscale.model import params
from mscale.model.params import INIT_STD, gain_names, global_init, name_seed

CFG = ModelConfig(layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=40, seq_len=8)


def test_name_seed_is_stable_across_processes_and_versions():
    # Pinned: a change here silently changes every run's initial weights.
    assert name_seed(1234, "embed.weight") == 4394049756591389530
    assert name_seed(1234, "embed.weight") != name_seed(1235, "embed.weight")


def test_init_depends_only_on_seed_and_name():
    a, b = Transformer(CFG), Transformer(CFG)
    init_weights(a, 7)
    init_weights(b, 7)
    stage = Transformer(CFG, layer_ids=[2], has_embedding=False)
    init_weights(stage, 7)
    full_a = dict(a.named_parameters())
    assert all(torch.equal(v, full_a[k]) for k, v in b.named_parameters())
    for name, value in stage.named_parameters():  # same weights at any split
        assert torch.equal(value, full_a[name]), name
    init_weights(b, 8)
    assert not torch.equal(full_a["embed.weight"], b.embed.weight)
    # Different names get different draws even with the same shape.
    assert not torch.equal(full_a["layers.0.attn.wq.weight"], full_a["layers.1.attn.wq.weight"])


def test_init_scales_residual_outputs_and_sets_norms_to_one():
    model = Transformer(CFG)
    init_weights(model, 0)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.1.mlp_norm.weight"], torch.ones(CFG.hidden))
    scaled = INIT_STD / math.sqrt(2 * CFG.layers)
    assert abs(params["layers.0.mlp.down.weight"].std().item() - scaled) < 0.2 * scaled
    assert abs(params["layers.0.mlp.up.weight"].std().item() - INIT_STD) < 0.2 * INIT_STD


def test_the_gains_are_exactly_the_norm_weights():
    model = Transformer(CFG.model_copy(update={"parallel_block": True}))
    assert gain_names(model) == {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}


def test_global_init_is_a_function_of_name_and_shape_only():
    one = global_init("layers.0.attn.wo.weight", (6, 8), 3, num_layers=2, gain=False)
    assert torch.equal(one, global_init("layers.0.attn.wo.weight", (6, 8), 3, 2, gain=False))
    assert one.std().item() < INIT_STD  # a residual output
    assert torch.equal(global_init("final_norm.weight", (5,), 3, 2, gain=True), torch.ones(5))


def _drawn_tiles(monkeypatch):
    """Record the tile names `fill_init` seeds a generator for."""
    drawn = []
    real = params.name_seed

    def recording(seed, name):
        drawn.append(name)
        return real(seed, name)
    monkeypatch.setattr(params, "name_seed", recording)
    return drawn


@pytest.mark.parametrize("shape,region", [
    ((40, 24), (slice(10, 20), slice(None))),      # rows of a column-parallel shard, mid-tile
    ((40, 24), (slice(None), slice(6, 12))),       # columns of a row-parallel shard
    ((40, 24), (slice(0, 40), slice(0, 24))),      # the whole tensor
    ((37,), (slice(5, 30),)),                      # a vector across block edges
])
def test_any_region_is_the_same_slice_of_the_global_tensor(monkeypatch, shape, region):
    monkeypatch.setattr(params, "TILE", 4)  # many tiles at test size (vectors: blocks of 16)
    full = global_init("layers.1.mlp.up.weight", shape, 5, 2, gain=False)
    part = torch.empty(full[region].shape, dtype=torch.bfloat16)
    params.fill_init(part, "layers.1.mlp.up.weight", shape, region, 5, 2, gain=False)
    assert torch.equal(part, full[region].to(torch.bfloat16))


def test_a_shard_draws_only_the_tiles_it_overlaps(monkeypatch):
    monkeypatch.setattr(params, "TILE", 4)
    drawn = _drawn_tiles(monkeypatch)
    out = torch.empty(40, 6)  # TP rank 1 of 4 of a row-parallel (40, 24) matrix: columns 6-11
    params.fill_init(out, "w", (40, 24), (slice(None), slice(6, 12)), 0, 2, gain=False)
    # 10 tile rows × the tile columns 1 and 2 (columns 4-7 and 8-11), not all 6 of them
    assert sorted(drawn) == sorted(f"w@{i},{j}" for i in range(10) for j in (1, 2))
    drawn.clear()
    global_init("w", (40, 24), 0, 2, gain=False)
    assert len(drawn) == 60


def test_the_tiles_are_pinned():
    # Pinned, as name_seed is: a change here silently changes every run's initial weights.
    w = global_init("layers.0.attn.wq.weight", (300, 2), 1234, 2, gain=False)
    expect = torch.empty(256, 2).normal_(
        0.0, INIT_STD, generator=torch.Generator().manual_seed(
            name_seed(1234, "layers.0.attn.wq.weight@0,0")))
    assert torch.equal(w[:256], expect)
    assert not torch.equal(w[256:258], expect[:2])  # the next tile row draws afresh
