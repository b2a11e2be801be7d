"""FLOPs and parameter counts against hand expansions of the docs/references.md formulas."""

import pytest

from mscale.config import ModelConfig
from mscale.planner import flops

GPT3 = dict(layers=96, hidden=12288, vocab=50257, seq_len=2048)


def test_gpt3_parameter_count_by_hand():
    # 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) expanded: 12·l·h² + 13·l·h + (V+s)·h
    l, h, V, s = 96, 12288, 50257, 2048
    by_hand = 12 * l * h * h + 13 * l * h + (V + s) * h
    assert by_hand == 174_604_234_752
    assert flops.gpt_parameters(**GPT3) == pytest.approx(by_hand, rel=1e-12)
    # Narayanan et al. (arXiv 2104.04473) Table 2 calls this model 174.6B
    assert round(flops.gpt_parameters(**GPT3) / 1e9, 1) == 174.6


def test_korthikanti_flops_by_hand():
    B, s, l, h, V = 6144, 2048, 96, 12288, 64000
    # 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) = 72Bslh² + 12Bs²lh + 6BshV
    by_hand = 72 * B * s * l * h * h + 12 * B * s * s * l * h + 6 * B * s * h * V
    assert flops.korthikanti_flops(B, s, l, h, V) == pytest.approx(by_hand, rel=1e-12)
    # full recompute: 96Bslh² + 16Bs²lh + 6BshV (one more forward of the blocks, not the logits)
    by_hand_full = 96 * B * s * l * h * h + 16 * B * s * s * l * h + 6 * B * s * h * V
    assert flops.full_recompute_flops(B, s, l, h, V) == pytest.approx(by_hand_full, rel=1e-12)


@pytest.mark.parametrize("l,h,a,V,s", [(96, 12288, 128, 64000, 2048), (4, 64, 4, 256, 64),
                                       (105, 20480, 160, 64000, 2048)])
def test_general_counting_matches_formulas_on_gpt_shapes(l, h, a, V, s):
    m = ModelConfig(layers=l, hidden=h, heads=a, vocab=V, seq_len=s, mlp="gelu")
    assert flops.model_flops(m, 8) == pytest.approx(flops.korthikanti_flops(8, s, l, h, V), rel=1e-12)
    full = flops.model_flops(m, 8) + flops.recompute_flops(m, 8, "full")
    assert full == pytest.approx(flops.full_recompute_flops(8, s, l, h, V), rel=1e-12)


def test_selective_recompute_repeats_only_attention_core():
    m = ModelConfig(layers=2, hidden=64, heads=4, vocab=256, seq_len=32, mlp="gelu")
    assert flops.recompute_flops(m, 3, "selective") == 3 * 2 * 4 * 32 * 32 * 64
    assert flops.recompute_flops(m, 3, "none") == 0


def test_megascale_mfu_reproduces_from_published_iteration_times():
    """docs/references.md: the paper's MFUs reproduce with a 312 TFLOP/s peak. Table 2 (batch 6144).

    The Korthikanti count comes out 1.0-1.2% (relative) above the paper's MFU column at every
    point, so the paper's own count differs slightly (it is not stated); 1.5% is the tolerance.
    """
    published = {3072: (23.66, 0.591), 6144: (12.21, 0.573), 8192: (9.56, 0.549),
                 12288: (6.34, 0.552)}
    f = flops.korthikanti_flops(6144, 2048, 96, 12288, 64000)
    for gpus, (iter_s, mfu) in published.items():
        assert f / (iter_s * gpus * 312e12) == pytest.approx(mfu, rel=0.015)
