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
"""

from __future__ import annotations

import json
import re

from mscale.config.model import ModelConfig

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


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json: LLaMA's fields, plus the exact ModelConfig under ``mscale_model``."""
    out = {
        "architectures": ["LlamaForCausalLM"] if is_llama(cfg) else ["MscaleForCausalLM"],
        "model_type": "llama" if is_llama(cfg) else "mscale",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.layers, "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu" if cfg.mlp == "swiglu" else "gelu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype,
        "mscale_model": cfg.model_dump(mode="json", exclude_none=True),
    }
    if cfg.sliding_window:
        out["sliding_window"] = cfg.sliding_window
    return out


def model_from_hf_config(data: dict, source: str) -> ModelConfig:
    """The ModelConfig of an HF directory: ``mscale_model`` if present, else LLaMA's fields."""
    from mscale.config.base import validate

    if "mscale_model" in data:
        return validate(ModelConfig, data["mscale_model"], source, prefix="mscale_model.")
    fields = {"name": data.get("_name_or_path", "hf"), "layers": data.get("num_hidden_layers"),
              "hidden": data.get("hidden_size"), "heads": data.get("num_attention_heads"),
              "kv_heads": data.get("num_key_value_heads"),
              "ffn_hidden": data.get("intermediate_size"), "vocab": data.get("vocab_size"),
              "seq_len": data.get("max_position_embeddings"),
              "norm_eps": data.get("rms_norm_eps", 1e-5), "rope_theta": data.get("rope_theta", 1e4),
              "tie_embeddings": data.get("tie_word_embeddings", False)}
    return validate(ModelConfig, {k: v for k, v in fields.items() if v is not None}, source)


def dumps_config(cfg: ModelConfig) -> str:
    return json.dumps(hf_config(cfg), indent=2) + "\n"
