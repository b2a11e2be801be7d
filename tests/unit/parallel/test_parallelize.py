"""The parallelize step in one process: names kept, the table, shards of the same init, recompute."""

import pytest
import torch

from mscale.config.model import ModelConfig
from mscale.errors import MscaleError
from mscale.model import Transformer, init_weights
from mscale.parallel.parallelize import (Recomputed, TensorParallelBlock, init_parameters,
                                         parallelize)
from mscale.parallel.tensor import TensorParallel

SINGLE = TensorParallel.single()
BASE = dict(layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=40, seq_len=12)


def cfg(**overrides):
    return ModelConfig(**{**BASE, **overrides})


def batch(c, b=3, seed=0):
    tokens = torch.randint(0, c.vocab, (b, c.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def on_meta(c, **stage):
    with torch.device("meta"):
        return Transformer(c, **stage)


def engine_model(c, tp=SINGLE, recompute="none", seed=0, **stage):
    """What `build_chunks` does: plain on meta, parallelized, only the shards allocated."""
    model, table = parallelize(on_meta(c, **stage), tp, recompute)
    model = model.to_empty(device="cpu")
    init_parameters(list(model.parameters()), table, seed, c.layers)
    return model, table


@pytest.mark.parametrize("overrides", [{}, dict(parallel_block=True, tie_embeddings=True)])
def test_names_and_order_are_the_plain_models_and_the_table_follows_them(overrides):
    c = cfg(**overrides)
    plain_names = [n for n, _ in Transformer(c).named_parameters()]
    model, table = parallelize(on_meta(c), SINGLE)
    assert [n for n, _ in model.named_parameters()] == plain_names == table.names
    assert list(model.state_dict()) == plain_names
    specs = {s.name: s for s in table}
    assert specs["layers.0.attn.wq.weight"].tp_dim == 0
    assert specs["layers.0.attn.wo.weight"].tp_dim == 1
    assert specs["layers.0.mlp.down.weight"].tp_dim == 1
    assert specs["embed.weight"].tp_dim == 0 and specs["final_norm.weight"].tp_dim is None
    assert all(s.weight_decay == (not s.name.endswith("norm.weight")) for s in table)
    # the table is data held by its users: nothing is attached to the parameters
    assert all(vars(p) == {} for p in model.parameters())


def test_at_tp1_the_engine_path_starts_from_the_plain_init_and_computes_the_same_loss():
    c = cfg()
    plain = Transformer(c)
    init_weights(plain, 5)
    model, _ = engine_model(c, seed=5)
    for (name, a), (_, b) in zip(plain.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    x, labels = batch(c)
    torch.testing.assert_close(model(x, labels), plain(x, labels), rtol=1e-6, atol=0)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-6, atol=0)


def test_parallelize_keeps_the_values_of_a_materialised_plain_model():
    c = cfg()
    plain = Transformer(c)
    init_weights(plain, 2)
    want = {n: p.detach().clone() for n, p in plain.named_parameters()}
    model, table = parallelize(plain, TensorParallel(group=None, size=2, rank=1))
    for p, spec in zip(model.parameters(), table):
        assert torch.equal(p, want[spec.name][table.local_slice(spec)]), spec.name


def test_each_tp_rank_holds_only_its_slice_of_the_same_initial_tensors():
    c = cfg(kv_heads=4)
    plain = Transformer(c)
    init_weights(plain, 9)
    full = dict(plain.named_parameters())
    for rank in range(4):
        model, table = engine_model(c, TensorParallel(group=None, size=4, rank=rank), seed=9)
        assert (table.tp_rank, table.tp_size) == (rank, 4)
        for p, spec in zip(model.parameters(), table):
            assert torch.equal(p, full[spec.name][spec.tp_slice(rank, 4)]), spec.name
        wq = dict(model.named_parameters())["layers.0.attn.wq.weight"]
        assert wq.shape == (c.hidden // 4, c.hidden)  # a quarter of the heads, allocated alone


@pytest.mark.parametrize("overrides", [{}, dict(parallel_block=True, sliding_window=4)])
def test_recompute_modes_give_identical_loss_and_gradients(overrides):
    c = cfg(**overrides)
    results = []
    for mode in ("none", "selective", "full"):
        model, _ = engine_model(c, recompute=mode)
        block = model.layers["0"]
        assert isinstance(block, TensorParallelBlock)
        assert isinstance(block.attn.core, Recomputed) == (mode == "selective")
        assert block.full_recompute == (mode == "full")
        x, labels = batch(c)
        loss = model(x, labels)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=1e-6, atol=1e-9)


def test_what_the_layout_cannot_split_is_refused_with_its_field():
    with pytest.raises(MscaleError, match="recompute") as e:
        parallelize(on_meta(cfg()), SINGLE, "some")
    assert e.value.field == "training.recompute"
    with pytest.raises(MscaleError, match="tp=3 does not divide heads") as e:
        parallelize(on_meta(cfg()), TensorParallel(group=None, size=3, rank=0))
    assert e.value.field == "layout.tp"


def test_a_module_the_step_does_not_know_is_refused_not_replicated_silently():
    model = on_meta(cfg())
    model.layers["0"].attn.extra = torch.nn.Linear(4, 4, bias=True)
    with pytest.raises(TypeError, match=r"layers\.0\.attn\.extra\.weight \(Linear\)"):
        parallelize(model, SINGLE)


def test_building_a_rank_imports_neither_dynamo_nor_sympy():
    """Every rank builds its chunks at start: nn.Embedding's default ``normal_`` and
    ``Module.to_empty`` on meta would import torch._dynamo and sympy, 1.5-2 s of CPU per rank
    (docs/benchmarks.md, "a --local job's start"). In a fresh interpreter, as a rank starts."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys, torch\n"
            "from mscale.parallel.parallelize import build_chunks\n"
            "from mscale.parallel.tensor import TensorParallel\n"
            "from tests.distributed.pipeline_plan import tiny_plan\n"
            "chunks, _ = build_chunks(tiny_plan(1, 2, 1), 0, TensorParallel.single(),\n"
            "                         torch.device('cpu'), seed=1)\n"
            "assert all(p.isfinite().all() for c in chunks for p in c.parameters())\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout
