"""HuggingFace-style export and import: LLaMA parameter names, safetensors files, config.json.

mscale's decoder is LLaMA's (RMSNorm, rotate-half rotary embeddings, grouped-query attention,
SwiGLU, no biases), and its weights are stored the way ``LlamaForCausalLM`` stores them
(``[out_features, in_features]``, heads contiguous in the output rows), so an export is a rename:

| mscale                        | HF (LLaMA)                                   |
|-------------------------------|----------------------------------------------|
| embed.weight                  | model.embed_tokens.weight                    |
| layers.{i}.attn_norm.weight   | model.layers.{i}.input_layernorm.weight      |
| layers.{i}.mlp_norm.weight    | model.layers.{i}.post_attention_layernorm.weight |
| layers.{i}.attn.w{q,k,v,o}.weight | model.layers.{i}.self_attn.{q,k,v,o}_proj.weight |
| layers.{i}.mlp.{gate,up,down}.weight | model.layers.{i}.mlp.{gate,up,down}_proj.weight |
| final_norm.weight             | model.norm.weight                            |
| head.weight                   | lm_head.weight                               |

Models LLaMA cannot express (a parallel block's single norm, a GeLU MLP, a sliding window) still
export with these names (the parallel block's ``norm`` as ``input_layernorm``), and config.json
says so: ``architectures`` is ``LlamaForCausalLM`` only for a plain LLaMA, and ``mscale_model``
always holds the exact ModelConfig, which the import reads back.

An import of a foreign LLaMA must never be silently wrong: config.json is read in both the
transformers 4 form (top-level ``rope_theta``, ``rope_scaling``) and the 5 form
(``rope_parameters``), and every value the model does not compute exactly like
``LlamaForCausalLM`` (another activation, biases, another rotary scaling, ...) is refused by
its HF name (`mscale.ckpt.hf_config`). A vocabulary the plan's TP does not divide is padded
with zero rows whose logits the model masks (`fit_to_plan`, `padded_region`); an export strips
them again (`hf_shape`, `strip_vocab_rows`).
"""

from __future__ import annotations

import json
import re

import torch

from mscale.config.model import ModelConfig
from mscale.errors import MscaleError

_RULES = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"final_norm\.weight", "model.norm.weight"),
    (r"head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
]
_BACK = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "final_norm.weight"),
    (r"lm_head\.weight", "head.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight", r"layers.\1.attn.w\2.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2.weight"),
]


def to_hf(name: str) -> str:
    """mscale global parameter name → HF LLaMA name."""
    for pattern, repl in _RULES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(f"no HF name for parameter {name}")


def from_hf(name: str, cfg: ModelConfig) -> str:
    """HF LLaMA name → mscale global parameter name (``input_layernorm`` is the parallel block's
    single norm when the model has one)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.input_layernorm\.weight", name)
    if m:
        return f"layers.{m.group(1)}.{'norm' if cfg.parallel_block else 'attn_norm'}.weight"
    for pattern, repl in _BACK:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(f"unknown HF tensor {name}")


def is_llama(cfg: ModelConfig) -> bool:
    """True when LlamaForCausalLM computes exactly what mscale does."""
    return cfg.mlp == "swiglu" and not cfg.parallel_block and cfg.sliding_window is None


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's ``rope_parameters`` of the model."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling.model_dump(exclude={"type"})
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **scaling}


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json: LLaMA's fields, plus the exact ModelConfig under ``mscale_model``.

    A padded vocabulary is exported unpadded (`unpadded`; the weights' padding rows are dropped
    by `strip_vocab_rows`). The rotary embedding is written in both generations' forms, top-level
    ``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (5), which agree.
    """
    cfg = unpadded(cfg)
    out = {
        "architectures": ["LlamaForCausalLM"] if is_llama(cfg) else ["MscaleForCausalLM"],
        "model_type": "llama" if is_llama(cfg) else "mscale",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.layers, "vocab_size": cfg.vocab, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope_parameters(cfg),
        "rope_scaling": rope_parameters(cfg) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu" if cfg.mlp == "swiglu" else "gelu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype,
        "mscale_model": cfg.model_dump(mode="json", exclude_none=True),
    }
    if cfg.sliding_window:
        out["sliding_window"] = cfg.sliding_window
    return out


def dumps_config(cfg: ModelConfig) -> str:
    return json.dumps(hf_config(cfg), indent=2) + "\n"


VOCAB_PARAMS = ("embed.weight", "head.weight")
"""The parameters with one row per vocabulary id (mscale names)."""


def unpadded(cfg: ModelConfig) -> ModelConfig:
    """The model without its vocabulary padding (itself when it has none)."""
    if cfg.real_vocab is None:
        return cfg
    return cfg.model_copy(update={"vocab": cfg.real_vocab, "real_vocab": None})


def padded_vocab(vocab: int, tp: int, plan_cfg: ModelConfig) -> int:
    """The vocabulary an import of ``vocab`` ids builds for a plan at ``tp``: ``vocab`` when TP
    divides it (and the plan does not name it as its ``real_vocab``), else the plan's own padded
    size when that fits and TP divides it, else the next multiple of TP."""
    if plan_cfg.real_vocab == vocab:
        return plan_cfg.vocab
    if vocab % tp == 0:
        return vocab
    if plan_cfg.vocab > vocab and plan_cfg.vocab % tp == 0:
        return plan_cfg.vocab
    return -(-vocab // tp) * tp


def pad_vocab(cfg: ModelConfig, vocab: int) -> ModelConfig:
    """``cfg`` with ``vocab`` rows, the original count kept as ``real_vocab``."""
    if vocab == cfg.vocab:
        return cfg
    data = cfg.model_dump()
    data.update(vocab=vocab, real_vocab=cfg.real_vocab or cfg.vocab)
    return ModelConfig.model_validate(data)


def padded_region(name: str, t: torch.Tensor, box, cfg: ModelConfig) -> torch.Tensor:
    """The region ``box`` (``(start, stop)`` per dimension) of HF tensor ``t`` as the padded
    model holds it: rows past ``real_vocab`` of the embedding and head are zeros. Reads only
    the rows it returns, so a memory-mapped input is never copied whole."""
    index = tuple(slice(a, b) for a, b in box)
    if name not in VOCAB_PARAMS or cfg.real_vocab is None or t.shape[0] != cfg.real_vocab:
        return t[index]
    (a, b), real = box[0], cfg.real_vocab
    inner = t[(slice(min(a, real), min(b, real)), *index[1:])]
    if inner.shape[0] == b - a:
        return inner
    return torch.cat([inner, inner.new_zeros((b - a - inner.shape[0], *inner.shape[1:]))])


def pad_vocab_rows(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A whole HF tensor as the padded model holds it (`padded_region` of everything)."""
    rows = cfg.vocab if name in VOCAB_PARAMS and cfg.real_vocab == t.shape[0] else t.shape[0]
    return padded_region(name, t, [(0, rows), *((0, d) for d in t.shape[1:])], cfg)


def strip_vocab_rows(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The rows of the real vocabulary only (embedding and head; others unchanged)."""
    if name not in VOCAB_PARAMS or cfg.real_vocab is None:
        return t
    return t[: cfg.real_vocab]


def hf_shape(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The shape `strip_vocab_rows` gives a tensor of ``shape``."""
    if name not in VOCAB_PARAMS or cfg.real_vocab is None:
        return tuple(shape)
    return (cfg.real_vocab, *shape[1:])


def diff_model(hf_cfg: ModelConfig, plan_cfg: ModelConfig) -> list[str]:
    """The ModelConfig fields on which an imported model and a plan's disagree (``name`` never
    counts). ``real_vocab`` is compared as the vocabulary the model really has (``real_vocab``,
    else ``vocab``): a plan that leaves it unset for an unpadded model agrees, but a plan of
    vocab 256 for a model of 255 padded to 256 does not: training it would leave the padding
    logit unmasked, another model with no word said. ``seq_len`` never counts either: an HF
    config's ``max_position_embeddings`` is the context the model supports (131,072 for
    Llama-3.1), not a length to train at, and no weight's shape depends on it."""
    a, b = (c.model_dump(exclude={"name", "seq_len"}) for c in (hf_cfg, plan_cfg))
    a["real_vocab"] = hf_cfg.real_vocab or hf_cfg.vocab
    b["real_vocab"] = plan_cfg.real_vocab or plan_cfg.vocab
    return [k for k in a if a[k] != b[k]]


def fit_to_plan(hf_cfg: ModelConfig, plan_cfg: ModelConfig, tp: int, source: str) -> ModelConfig:
    """The model an import writes for a plan: the HF model, its vocabulary padded for ``tp``,
    under the plan's name and with its ``seq_len`` (the training length, whatever the HF
    model's ``max_position_embeddings``), with ``real_vocab`` recorded so an export restores
    the original.

    Refuses a plan whose model differs, naming every differing field with both values."""
    cfg = pad_vocab(hf_cfg, padded_vocab(hf_cfg.vocab, tp, plan_cfg))
    diffs = diff_model(cfg, plan_cfg)
    if diffs:
        a, b = cfg.model_dump(), plan_cfg.model_dump()
        detail = "; ".join(f"{k}: {a[k]!r} in config.json, {b[k]!r} in the plan" for k in diffs)
        fix = "use a plan whose model: section matches the HF config"
        if diffs == ["real_vocab"]:
            fix = (f"set model.real_vocab: {hf_cfg.vocab} in the plan (the HF model's "
                   f"vocabulary; model.vocab {cfg.vocab} pads it for tp {tp})")
        raise MscaleError(f"config.json describes a different model than the plan ({detail})",
                          file=source, field=", ".join(f"model.{k}" for k in diffs), fix=fix)
    return cfg.model_copy(update={"name": plan_cfg.name, "seq_len": plan_cfg.seq_len})
