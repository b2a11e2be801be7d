"""ModelConfig's bounds: every number a typo could make absurd is refused by its field."""

import pytest

from mscale.config.base import validate
from mscale.config.model import ModelConfig
from mscale.errors import MscaleError

OK = dict(layers=2, hidden=64, heads=4, vocab=256, seq_len=64)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)


@pytest.mark.parametrize("edit,field", [
    (dict(layers=10_001), "layers"), (dict(hidden=1_000_064), "hidden"),
    (dict(ffn_hidden=10**8), "ffn_hidden"), (dict(vocab=10**9), "vocab"),
    (dict(seq_len=10**9), "seq_len"), (dict(sliding_window=10**9), "sliding_window"),
    (dict(norm_eps=0.0), "norm_eps"), (dict(norm_eps=float("nan")), "norm_eps"),
    (dict(norm_eps=2.0), "norm_eps"),
    (dict(rope_theta=0.0), "rope_theta"), (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_theta=float("inf")), "rope_theta"), (dict(rope_theta=float("nan")), "rope_theta"),
    (dict(real_vocab=0), "real_vocab"), (dict(name="x" * 201), "name"),
    (dict(schema_version=2), "schema_version"),
    (dict(rope_scaling={**LLAMA3, "factor": 0.5}), "rope_scaling.factor"),
    (dict(rope_scaling={**LLAMA3, "factor": float("inf")}), "rope_scaling.factor"),
    (dict(rope_scaling={**LLAMA3, "type": "yarn"}), "rope_scaling.type"),
    (dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": 0}),
     "rope_scaling.original_max_position_embeddings"),
])
def test_out_of_bounds_values_are_refused_by_field(edit, field):
    with pytest.raises(MscaleError) as e:
        validate(ModelConfig, {**OK, **edit}, "m.yaml")
    assert e.value.field == field and "unknown field" not in e.value.message


@pytest.mark.parametrize("edit, field", [
    (dict(real_vocab=300), "real_vocab"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "rope_scaling.high_freq_factor"),
    (dict(hidden=66), "hidden"), (dict(kv_heads=3), "kv_heads")])
def test_inconsistent_values_are_refused_naming_the_field(edit, field):
    with pytest.raises(MscaleError, match="exceeds vocab|must exceed low_freq_factor|divisible"
                       ) as e:
        validate(ModelConfig, {**OK, **edit}, "m.yaml")
    assert e.value.field == field


def test_largest_sane_models_and_llama3_scaling_are_accepted():
    m = validate(ModelConfig, {**OK, "layers": 10_000, "hidden": 1_000_000, "heads": 1000,
                               "vocab": 10_000_000, "seq_len": 100_000_000, "real_vocab": 256,
                               "rope_theta": 1e9, "rope_scaling": LLAMA3}, "m.yaml")
    assert m.rope_scaling.key() == (8.0, 1.0, 4.0, 8192)
