"""FLOPs that know the model: grouped-query K/V, SwiGLU, parallel blocks, sliding windows."""

import pytest

from mscale.config import ModelConfig
from mscale.planner import flops

BASE = dict(name="m", layers=4, hidden=4096, heads=32, vocab=32000, seq_len=8192)


def test_gqa_and_swiglu_matrices():
    m = ModelConfig(**BASE, kv_heads=8, ffn_hidden=14336)
    h, kv = 4096, 8 * 128
    assert flops.layer_matrix_params(m) == 2 * h * h + 2 * h * kv + 3 * h * 14336


def test_parallel_block_has_one_norm():
    seq = ModelConfig(**BASE, ffn_hidden=11008)
    par = ModelConfig(**BASE, ffn_hidden=11008, parallel_block=True)
    assert flops.layer_params(seq) - flops.layer_params(par) == 4096
    assert flops.layer_forward_flops(seq) == flops.layer_forward_flops(par)


def test_sliding_window_scores_only_its_band():
    full = ModelConfig(**BASE, ffn_hidden=11008)
    win = ModelConfig(**BASE, ffn_hidden=11008, sliding_window=4096)
    s, h = 8192, 4096
    assert flops.attention_core_forward_flops(full) == 4 * s * s * h
    assert flops.attention_core_forward_flops(win) == 4 * s * 4096 * h
    assert flops.attention_core_forward_flops(win, executed=True) == 4 * s * s * h  # masked SDPA
    gap = flops.layer_forward_flops(full) - flops.layer_forward_flops(win)
    assert gap == pytest.approx(4 * s * (s - 4096) * h)
    # recompute repeats what the model computes: selective = the (windowed) attention core
    core = flops.attention_core_forward_flops(win)
    assert flops.recompute_flops(win, 8, "selective") == 8 * 4 * core


def test_window_longer_than_the_sequence_changes_nothing():
    full = ModelConfig(**BASE, ffn_hidden=11008)
    wide = ModelConfig(**BASE, ffn_hidden=11008, sliding_window=16384)
    assert flops.model_flops(wide, 8) == flops.model_flops(full, 8)
