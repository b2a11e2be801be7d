"""A foreign LLaMA config.json → ModelConfig, refusing what mscale would compute differently.

The import must never be silently wrong: a value that ``LlamaForCausalLM`` honours and mscale's
decoder does not (a GeLU activation, biases, a yarn-scaled rotary, a head_dim that is not
hidden/heads, ...) is an error naming the HF field, never a model that "imports successfully"
and computes something else. Both generations of transformers' config.json are read: version 4
writes a top-level ``rope_theta`` and ``rope_scaling``; version 5 writes ``rope_parameters``
(``rope_theta``, ``rope_type``, scaling numbers) and no top-level ``rope_theta``.

Values only training-time HF features use (``initializer_range``, ``use_cache``, token ids,
``pretraining_tp``, whose split matmuls compute the same product) are ignored, as are keys
``LlamaForCausalLM`` itself ignores.
"""

from __future__ import annotations

from typing import Any

from mscale.ckpt import hf
from mscale.config.base import validate
from mscale.config.model import ModelConfig
from mscale.errors import MscaleError

REQUIRED = {"num_hidden_layers": "layers", "hidden_size": "hidden",
            "num_attention_heads": "heads", "intermediate_size": "ffn_hidden",
            "vocab_size": "vocab"}
"""HF fields that fix the weights' shapes: a config.json without them is refused, not given
transformers' 7B defaults."""
OPTIONAL = {"num_key_value_heads": ("kv_heads", None),
            "max_position_embeddings": ("seq_len", 2048),
            "rms_norm_eps": ("norm_eps", 1e-6),
            "tie_word_embeddings": ("tie_embeddings", False)}
"""HF field → (ModelConfig field, LlamaConfig's default when absent)."""
ACCEPTED = {"model_type": ("llama",), "hidden_act": ("silu", "swish"),
            "attention_bias": (False,), "mlp_bias": (False,), "attention_dropout": (0,),
            "partial_rotary_factor": (1,), "quantization_config": (None,),
            "architectures": (None, ["LlamaForCausalLM"])}
"""HF field → the values with which LlamaForCausalLM computes what mscale computes (an absent
field takes LlamaConfig's default, which is always accepted)."""
ROPE_TYPES = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}
"""Rotary variants mscale implements, with the numbers each needs."""
ROPE_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
DEFAULT_THETA = 10000.0


def refuse(source: str, field: str, message: str, fix: str) -> MscaleError:
    return MscaleError(message, file=source, field=field, fix=fix)


def short(value: Any) -> str:
    """A value as the message shows it: config.json may hold anything, of any size."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _derived(head_dim: Any, heads: Any, hidden: Any) -> bool:
    """Whether ``head_dim`` is what mscale derives, hidden / heads (a bad ``heads`` is left to
    its own check)."""
    if not _is_number(head_dim):
        return False
    try:
        return not _is_number(heads) or head_dim * heads == hidden
    except OverflowError:  # a 400-digit integer times a float
        return False


def check_supported(data: dict, source: str) -> None:
    """Refuse every value of `ACCEPTED` (and a ``head_dim`` other than hidden/heads) that would
    make LlamaForCausalLM compute something mscale does not."""
    for field, allowed in ACCEPTED.items():
        if field in data and data[field] not in allowed:
            raise refuse(source, field, f"mscale's decoder does not implement {field}="
                         f"{short(data[field])}", f"only {' or '.join(map(repr, allowed))} "
                         "computes what mscale computes: import a plain LLaMA checkpoint")
    head_dim, heads, hidden = (data.get(k) for k in ("head_dim", "num_attention_heads",
                                                      "hidden_size"))
    if head_dim is not None and not _derived(head_dim, heads, hidden):
        raise refuse(source, "head_dim", f"head_dim={short(head_dim)} is not hidden_size / "
                     f"num_attention_heads ({short(hidden)} / {short(heads)}); mscale derives it",
                     "import a model whose head_dim equals hidden_size / num_attention_heads")


def _rope_block(key: str, d: Any, data: dict, source: str) -> tuple[dict, dict]:
    """One rotary description (``rope_parameters`` or ``rope_scaling``) → ModelConfig fields and
    where each came from."""
    if not isinstance(d, dict):
        raise refuse(source, key, f"{key} must be a mapping, got {short(d)}", "fix config.json")
    kind = d.get("rope_type", d.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise refuse(source, f"{key}.rope_type", f"rope_type {short(kind)} is not implemented by "
                     f"mscale (only {', '.join(ROPE_TYPES)})", "import a model with plain or "
                     "Llama-3 rotary embeddings")
    extra = sorted(map(str, set(d) - ROPE_COMMON - set(ROPE_TYPES[kind])))
    if extra:
        name = extra[0][:80]
        raise refuse(source, f"{key}.{name}", f"{name} is not used by rope_type {kind!r} in "
                     "mscale", "remove it, or import a model that does not need it")
    if d.get("partial_rotary_factor", 1) != 1:
        raise refuse(source, f"{key}.partial_rotary_factor", "partial rotary embeddings are "
                     "not implemented by mscale", "import a model with a fully rotated head")
    theta, top = d.get("rope_theta"), data.get("rope_theta")
    if theta is not None and top is not None and theta != top:
        raise refuse(source, f"{key}.rope_theta", f"{key}.rope_theta={short(theta)} and "
                     f"rope_theta={short(top)} disagree", "keep one value")
    out = {"rope_theta": DEFAULT_THETA if theta is None and top is None else
           theta if theta is not None else top}
    where = {"rope_theta": f"{key}.rope_theta" if theta is not None else "rope_theta",
             "rope_scaling": key}
    if kind == "llama3":
        scaling = {"original_max_position_embeddings": data.get("max_position_embeddings", 2048),
                   **{k: d[k] for k in ROPE_TYPES[kind] if k in d}}
        missing = [k for k in ROPE_TYPES[kind] if k not in scaling]
        if missing:
            raise refuse(source, f"{key}.{missing[0]}", f"rope_type llama3 needs {missing[0]}",
                         "add it (Llama-3.1: factor 8, low_freq_factor 1, high_freq_factor 4, "
                         "original_max_position_embeddings 8192)")
        out["rope_scaling"] = {"type": "llama3", **scaling}
    return out, where


def rope_fields(data: dict, source: str) -> tuple[dict, dict]:
    """``rope_theta`` (and ``rope_scaling``) from either config.json generation, and the HF
    field each came from. Both forms present and disagreeing is refused: transformers 4 and 5
    would each read a different one."""
    blocks = [_rope_block(k, data[k], data, source)
              for k in ("rope_scaling", "rope_parameters") if data.get(k)]
    if len(blocks) == 2 and blocks[0][0] != blocks[1][0]:
        raise refuse(source, "rope_parameters", "rope_scaling and rope_parameters describe "
                     "different rotary embeddings", "keep one of them")
    if blocks:
        return blocks[-1]
    top = data.get("rope_theta")
    return {"rope_theta": DEFAULT_THETA if top is None else top}, {"rope_theta": "rope_theta"}


def llama_fields(data: dict, source: str) -> tuple[dict, dict[str, str]]:
    """ModelConfig fields of a LLaMA config.json, and ModelConfig field → HF field (errors)."""
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        raise refuse(source, missing[0], f"{missing[0]} is missing", "config.json must give "
                     f"{', '.join(REQUIRED)}")
    check_supported(data, source)
    fields = {mine: data[hf] for hf, mine in REQUIRED.items()}
    names = {mine: hf for hf, mine in REQUIRED.items()}
    for hf, (mine, default) in OPTIONAL.items():
        value = data.get(hf, default)
        if value is not None:
            fields[mine], names[mine] = value, hf
    rope, where = rope_fields(data, source)
    fields.update(rope)
    names.update(where)
    fields["name"] = str(data.get("_name_or_path") or "hf")[-200:]
    return fields, names


def _check_agrees(data: dict, cfg: ModelConfig, source: str) -> None:
    """An mscale export carries both LLaMA's size fields and the exact ``mscale_model``; they
    must say the same thing (transformers reads the first, mscale the second), and the shape
    fields must be there: a config.json edited on one side only is refused by its HF field."""
    expected = hf.hf_config(cfg)
    for key in (*REQUIRED, "num_key_value_heads"):
        if key not in data:
            raise refuse(source, key, "missing beside mscale_model", "restore the field as the "
                         f"export wrote it ({short(expected[key])}), or drop mscale_model")
        if data[key] != expected[key] or isinstance(data[key], bool):
            raise refuse(source, key, f"{short(data[key])} disagrees with mscale_model "
                         f"({short(expected[key])})", "make the two agree (re-export the "
                         "checkpoint), or drop mscale_model to import the LLaMA fields")


def model_from_hf_config(data: dict, source: str) -> ModelConfig:
    """The ModelConfig of an HF directory: ``mscale_model`` if present (an mscale export), else
    LLaMA's fields, every unsupported value refused and every error named by its HF field."""
    if not isinstance(data, dict):
        raise refuse(source, "(top level)", f"config.json must be a JSON object, got "
                     f"{type(data).__name__}", "import an HF model directory's config.json")
    if "mscale_model" in data:
        cfg = validate(ModelConfig, data["mscale_model"], source, prefix="mscale_model.")
        _check_agrees(data, cfg, source)
        return cfg
    fields, names = llama_fields(data, source)
    try:
        return validate(ModelConfig, fields, source)
    except MscaleError as e:
        head, _, rest = (e.field or "").partition(".")
        if head in names:
            e.field = ".".join(p for p in (names[head], rest) if p)
        raise
