"""FLOPs and parameter counts: what a step must compute, the numerator of MFU.

Model FLOPs follow Korthikanti et al. (arXiv 2205.05198): every matrix multiply, attention scores
included, counted once per forward and twice per backward; recomputation is not model work (it
counts towards HFU only). The literal docs/references.md formulas are here too, so that tests can check the
general per-layer counting against them on GPT-shaped models.
"""

from __future__ import annotations

from mscale.config.model import ModelConfig


def gpt_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """docs/references.md: parameters of a GPT, ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` (with biases and
    learned positions, as GPT-3 has them)."""
    l, h = layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def korthikanti_flops(batch: float, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """docs/references.md: model FLOPs per iteration of a GPT with a 4h MLP, no recompute:
    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``."""
    s, l, h = seq_len, layers, hidden
    return 72 * batch * s * l * h**2 * (1 + s / (6 * h) + vocab / (12 * l * h))


def full_recompute_flops(batch: float, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """docs/references.md (Narayanan et al. eq. 3): hardware FLOPs with full recompute,
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``."""
    s, l, h = seq_len, layers, hidden
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + vocab / (16 * l * h))


def layer_matrix_params(model: ModelConfig) -> int:
    """Weights of one block's matrix multiplies (what costs FLOPs): Q, K, V, O and the MLP."""
    h, kv = model.hidden, model.num_kv_heads * model.head_dim
    mlp = (3 if model.mlp == "swiglu" else 2) * h * model.ffn
    return 2 * h * h + 2 * h * kv + mlp


def layer_params(model: ModelConfig) -> int:
    """All weights of one block: matrices plus norm scales (what costs memory)."""
    return layer_matrix_params(model) + (1 if model.parallel_block else 2) * model.hidden


def attention_keys(model: ModelConfig) -> int:
    """Keys each query is scored against: the sequence, or the sliding window when shorter.

    Korthikanti's count (no causal halving: a full row of keys per query) applied to the band a
    window leaves. Model work only: this engine's windowed attention is SDPA with a boolean mask
    (model/transformer.py), whose kernels still compute all s scores per query, so its
    *executed* attention FLOPs are the unwindowed ones (`attention_core_forward_flops` with
    ``executed=True``)."""
    s, w = model.seq_len, model.sliding_window
    return min(w, s) if w else s


def layer_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs of one block for one sequence: 2 per weight per token (Q, K, V and O with
    grouped-query K/V widths, the MLP's two or three matrices), plus QKᵀ and A·V (2·keys·h each
    per token, Korthikanti's count: no causal halving; keys = `attention_keys`)."""
    return 2 * layer_matrix_params(model) * model.seq_len + attention_core_forward_flops(model)


def attention_core_forward_flops(model: ModelConfig, executed: bool = False) -> float:
    """QKᵀ and A·V of one block for one sequence (what selective recompute repeats):
    ``4·s·keys·h``. ``executed``: what a masked kernel computes, all ``s`` keys."""
    keys = model.seq_len if executed else attention_keys(model)
    return 4 * model.seq_len * keys * model.hidden


def head_forward_flops(model: ModelConfig) -> float:
    """Forward FLOPs of the output projection (logits) for one sequence."""
    return 2 * model.seq_len * model.hidden * model.vocab


def model_flops(model: ModelConfig, batch: float) -> float:
    """Model FLOPs of one iteration over ``batch`` sequences (forward + backward = 3 forwards).

    For a GPT with a 4h MLP this equals `korthikanti_flops` (tests check it).
    """
    per_seq = model.layers * layer_forward_flops(model) + head_forward_flops(model)
    return 3 * batch * per_seq


def recompute_flops(model: ModelConfig, batch: float, recompute: str) -> float:
    """Extra hardware FLOPs that recomputation adds per iteration (no model progress).

    full: one more forward of every block (the logits are not recomputed, as in eq. 3);
    selective: only the attention core (Korthikanti et al. §5).
    """
    if recompute == "full":
        return batch * model.layers * layer_forward_flops(model)
    if recompute == "selective":
        return batch * model.layers * attention_core_forward_flops(model)
    return 0.0
