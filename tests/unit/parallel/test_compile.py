"""Regional compilation: the compiled regions compute what eager does, without a graph break,
one graph per region kind whatever the depth; sequence-parallel norms and hooks stay outside.

On CPU with ``aot_eager``: dynamo's capture and AOTAutograd's forward/backward split, the part
that breaks on a graph break or an untraceable op, without inductor's minutes of C++ builds.
"""

import pytest
import torch

from mscale.config.model import ModelConfig
from mscale.model.transformer import rms_norm
from mscale.parallel.compile import compile_blocks, is_compiled, wants_compile
from mscale.parallel.param_gather import _hook_owners
from mscale.parallel.parallelize import parallelize
from mscale.parallel.tensor import TensorParallel
from tests.unit.parallel.test_parallelize import batch, engine_model, on_meta

BASE = dict(layers=3, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=40, seq_len=12)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("recompute,model", [
    ("none", {}),
    ("selective", dict(sliding_window=5)),
    ("full", dict(parallel_block=True, mlp="gelu")),
])
def test_compiled_regions_compute_what_eager_does_without_a_graph_break(recompute, model):
    c = ModelConfig(**{**BASE, **model})
    eager, _ = engine_model(c, recompute=recompute, seed=3)
    compiled, _ = engine_model(c, recompute=recompute, seed=3)
    regions = compile_blocks([compiled], backend="aot_eager", fullgraph=True)  # a break raises
    assert len(regions) == c.layers * (3 if c.parallel_block else 4)
    x, labels = batch(c)
    for _ in range(2):  # the second call runs the cached graphs
        want, got = eager(x, labels), compiled(x, labels)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    # compiled in place: the names (checkpoints, the ParamTable) are unchanged
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]


def test_every_layer_reuses_one_graph_per_region_kind():
    from torch._dynamo.utils import counters

    graphs = {}
    for layers in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        c = ModelConfig(**{**BASE, "layers": layers})
        model, _ = engine_model(c)
        compile_blocks([model], backend="aot_eager", fullgraph=True)
        model(*batch(c)).backward()
        graphs[layers] = counters["stats"]["unique_graphs"]
    assert graphs[2] == graphs[6] == 3  # attention, MLP, norm: not one per layer


def test_a_sequence_parallel_norm_compiles_its_normalisation_only():
    c = ModelConfig(**BASE)
    tp = TensorParallel(group=None, size=2, rank=0, sequence_parallel=True)
    model, _ = parallelize(on_meta(c), tp)
    regions = compile_blocks([model], backend="aot_eager")
    assert len(regions) == 4 * c.layers
    norms = [getattr(b, n) for b in model.layers.values() for n in ("attn_norm", "mlp_norm")]
    # the module (its hook, the gain's all-reducing function) stays eager
    assert not any(is_compiled(n) for n in norms)
    assert all(n.normalize is not rms_norm for n in norms)
    assert is_compiled(model.layers["0"].attn) and is_compiled(model.layers["0"].mlp)


def test_zero_hooks_go_on_the_nearest_uncompiled_module():
    c = ModelConfig(**BASE)
    model, _ = engine_model(c)
    compile_blocks([model], backend="aot_eager")
    owners = dict((id(m), own) for m, own in _hook_owners(model))
    block = model.layers["0"]
    assert id(block.attn) not in owners and id(block.attn.wq) not in owners
    assert {id(p) for p in owners[id(block)]} == {id(p) for p in block.parameters()}
    every = [id(p) for own in owners.values() for p in own]
    assert sorted(every) == sorted(id(p) for p in model.parameters())  # each one exactly once


def test_compile_defaults_to_cuda_only():
    assert wants_compile(None, torch.device("cuda", 0))
    assert not wants_compile(None, torch.device("cpu"))
    assert wants_compile(True, torch.device("cpu"))
    assert not wants_compile(False, torch.device("cuda"))


@pytest.mark.parametrize("compiled", [False, True])
def test_compiled_regions_leave_the_root_waiting_for_no_more_buckets_than_eager(compiled):
    """ZeRO's deferred all-gathers overlap the forward only if each bucket is waited for where
    its parameters are used. The modules inside a compiled region have no hook of their own, and
    were counted as never run: the root then waited for every bucket before the first layer, on
    GPUs (compile's default) an exposed all-gather of every parameter every step."""
    from mscale.parallel.buckets import BufferLayout
    from mscale.parallel.param_gather import ParamGather

    c = ModelConfig(**BASE)
    model, table = engine_model(c)
    if compiled:
        compile_blocks([model], backend="aot_eager")
    params = list(model.parameters())
    layout = BufferLayout(params, table, 1, 64)  # small buckets: many, one layer spans several
    gather = ParamGather(params, layout, None, device=torch.device("cpu"), whole=False,
                         flatten=True)
    gather.attach_modules([model])
    x, labels = batch(c)
    model(x, labels)
    head = {s.bucket for s in layout.slots if table.names[s.index] == "head.weight"}
    assert len(layout.buckets) > 8
    assert set(gather._roots[id(model)]) <= head  # the head's F.linear at most, as in eager
