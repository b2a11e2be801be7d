"""Llama-3 rotary scaling and a padded vocabulary (what an HF import needs), in one process."""

import math

import pytest
import torch
import torch.nn.functional as F

from mscale.config.model import ModelConfig
from mscale.model import Transformer, init_weights
from mscale.model.transformer import mask_padding, rope_frequencies

BASE = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=40, seq_len=12)
SCALING = (8.0, 1.0, 4.0, 32)  # factor, low_freq_factor, high_freq_factor, original context


def test_llama3_scaling_keeps_short_divides_long_and_blends_middle_wavelengths():
    plain = rope_frequencies(16, 10000.0)
    scaled = rope_frequencies(16, 10000.0, SCALING)
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 32 / 4, wavelen > 32 / 1
    middle = ~short & ~long
    assert short.any() and long.any() and middle.any()
    torch.testing.assert_close(scaled[short], plain[short], rtol=0, atol=0)
    torch.testing.assert_close(scaled[long], plain[long] / 8, rtol=1e-15, atol=0)
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_rope_scaling_changes_the_model_and_default_is_plain_rope():
    cfg = ModelConfig(**BASE)
    scaled_cfg = ModelConfig(**BASE, rope_scaling=dict(factor=8.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0,
                                                       original_max_position_embeddings=4))
    plain, scaled = Transformer(cfg), Transformer(scaled_cfg)
    init_weights(plain, 0)
    scaled.load_state_dict(plain.state_dict())
    x = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(plain(x), scaled(x))


def padded_model():
    cfg = ModelConfig(**{**BASE, "vocab": 40, "real_vocab": 37})
    model = Transformer(cfg)
    init_weights(model, 0)
    return model


def test_padded_vocabulary_is_masked_and_the_loss_is_the_unpadded_models():
    model = padded_model()
    x = torch.randint(0, 37, (3, 13), generator=torch.Generator().manual_seed(0))
    x, labels = x[:, :-1], x[:, 1:]
    logits = model(x)
    assert (logits[..., 37:] == torch.finfo(logits.dtype).min).all()
    want = F.cross_entropy(logits[..., :37].reshape(-1, 37), labels.reshape(-1))
    loss = model(x, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    loss.backward()
    assert not model.head.weight.grad[37:].any()  # padding rows never learn


@pytest.mark.parametrize("size,rank,vocab,real,masked", [
    (2, 0, 40, 37, []), (2, 1, 40, 37, [17, 18, 19]), (4, 3, 48, 20, list(range(12))),
])
def test_each_tp_rank_masks_only_the_padding_in_its_slice(size, rank, vocab, real, masked):
    per_rank = vocab // size
    out = mask_padding(torch.zeros(2, 1, per_rank), real, first_id=rank * per_rank)
    assert (out[0, 0] != 0).nonzero().flatten().tolist() == masked
