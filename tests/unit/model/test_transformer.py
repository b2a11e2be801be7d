"""The plain decoder in one process: shapes, attention variants, blocks, stages, precision."""

import math

import pytest
import torch
import torch.nn.functional as F

from mscale.config.model import ModelConfig
from mscale.errors import MscaleError
from mscale.model import Transformer, init_weights
from mscale.model.transformer import apply_rotary, attention_core

BASE = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=40, seq_len=12)


def make(seed=0, **overrides):
    cfg = ModelConfig(**{**BASE, **overrides.pop("model", {})})
    model = Transformer(cfg, **overrides)
    init_weights(model, seed)
    return model


def batch(cfg, b=3, seed=0):
    tokens = torch.randint(0, cfg.vocab, (b, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def test_shapes_and_parameter_count():
    model = make()
    cfg = model.cfg
    x, labels = batch(cfg)
    assert model(x).shape == (3, cfg.seq_len, cfg.vocab)
    loss = model(x, labels)
    assert loss.shape == () and math.isfinite(loss.item())
    hidden = Transformer(cfg, has_head=False)(x)
    assert hidden.shape == (cfg.seq_len, 3, cfg.hidden)  # sequence-first
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    tied = make(model=dict(tie_embeddings=True, parallel_block=True))
    assert sum(p.numel() for p in tied.parameters()) == tied.cfg.num_parameters()


def test_loss_is_mean_cross_entropy_of_the_logits():
    model = make()
    x, labels = batch(model.cfg)
    expected = F.cross_entropy(model(x).reshape(-1, model.cfg.vocab), labels.reshape(-1))
    torch.testing.assert_close(model(x, labels), expected, rtol=1e-6, atol=0)


def test_rotary_scores_depend_only_on_distance():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def score(m, n):  # query at position m, key at position n
        seq = max(m, n) + 1
        qs = apply_rotary(q.expand(seq, 1, 1, 16).contiguous(), 10000.0)
        ks = apply_rotary(k.expand(seq, 1, 1, 16).contiguous(), 10000.0)
        return (qs[m] * ks[n]).sum().item()

    assert score(3, 1) == pytest.approx(score(9, 7), rel=1e-5)
    assert score(5, 5) == pytest.approx(score(0, 0), rel=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def naive_attention(q, k, v, window):
    """Softmax over an explicit mask: query i sees keys j with i - window < j <= i."""
    s, d = q.shape[2], q.shape[3]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    allowed = torch.tensor([[0 <= i - j < (window or s) for j in range(s)] for i in range(s)])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("window", [None, 1, 3, 11, 50])
def test_sliding_window_matches_naive_reference(window):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(attention_core(q, k, v, window), naive_attention(q, k, v, window),
                               rtol=1e-5, atol=1e-6)


def test_window_of_one_attends_only_to_itself():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=gen) for _ in range(3))
    torch.testing.assert_close(attention_core(q, k, v, 1), v)


def test_window_at_least_the_sequence_is_full_causal():
    x, labels = batch(ModelConfig(**BASE))
    assert make(model=dict(sliding_window=BASE["seq_len"]))(x, labels) == make()(x, labels)
    assert make(model=dict(sliding_window=4))(x, labels) != make()(x, labels)


def test_gqa_equals_mha_with_repeated_key_value_heads():
    gqa = make(model=dict(kv_heads=2))
    mha = make(model=dict(kv_heads=4))
    d, group = gqa.cfg.head_dim, gqa.cfg.heads // gqa.cfg.num_kv_heads
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # kv head j serves q heads
                p.copy_(src.view(-1, d, src.shape[1]).repeat_interleave(group, 0).flatten(0, 1))
            else:
                p.copy_(src)
    x, labels = batch(gqa.cfg)
    torch.testing.assert_close(gqa(x, labels), mha(x, labels), rtol=1e-6, atol=0)


def test_parallel_block_sums_attention_and_mlp_of_one_norm():
    model = make(model=dict(parallel_block=True))
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.norm.weight" in names and "layers.0.attn_norm.weight" not in names
    block = model.layers["0"]
    x = torch.randn(5, 2, model.cfg.hidden)
    h = block.norm(x)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.mlp(h))


def test_two_stages_compute_what_the_whole_model_does():
    whole = make()
    first = make(layer_ids=[0], has_head=False)
    second = make(layer_ids=[1], has_embedding=False)
    x, labels = batch(whole.cfg)
    torch.testing.assert_close(second(first(x), labels), whole(x, labels), rtol=1e-6, atol=0)
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in second.named_parameters()} \
        == {n for n, _ in whole.named_parameters()}


def test_tied_embeddings_share_one_weight_and_refuse_a_pipeline_split():
    model = make(model=dict(tie_embeddings=True))
    assert "head.weight" not in dict(model.named_parameters())
    cfg = model.cfg
    with pytest.raises(MscaleError, match="tied embeddings"):
        Transformer(cfg, has_head=False)
    with pytest.raises(MscaleError, match="tied embeddings"):
        Transformer(cfg, has_embedding=False)


def test_bad_arguments_are_refused():
    cfg = ModelConfig(**BASE)
    with pytest.raises(ValueError, match="layer_ids"):
        Transformer(cfg, layer_ids=[0, 2])


def test_bf16_autocast_keeps_fp32_parameters_and_a_close_loss():
    fp32 = make()
    bf16 = make()
    x, labels = batch(fp32.cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = bf16(x, labels)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in bf16.parameters())
    assert loss.item() == pytest.approx(fp32(x, labels).item(), rel=2e-2)
