"""HF import and export against stock `transformers`: configs and weights written by
``LlamaConfig`` / ``LlamaForCausalLM.save_pretrained`` itself, logits compared with
``LlamaForCausalLM``'s, and every config value mscale does not implement refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from mscale.ckpt import hf, hf_config
from mscale.ckpt.convert import convert, open_hf
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import MODEL, tensor_key
from mscale.config.base import dump_yaml
from mscale.config.model import ModelConfig
from mscale.errors import MscaleError
from mscale.model import Transformer, init_weights
from tests.unit.ckpt.helpers import plan, write_synthetic

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
DEFAULT_500K = {"rope_type": "default", "rope_theta": 500000.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""Llama-3.1's rule with a pre-training context of 32 tokens, so that 32-token inputs see it."""
SCALING = {k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")}


def save_llama(path, vocab=128, rope=DEFAULT_500K, form="v5", **extra):
    """A random LlamaForCausalLM saved by transformers (``form="v4"``: config.json rewritten in
    transformers 4's form, top-level ``rope_theta`` and ``rope_scaling``)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, rope_parameters=dict(rope),
                                      initializer_range=0.2, **SHAPE, **extra)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    if form == "v4":
        data = json.loads((path / "config.json").read_text())
        rope_params = data.pop("rope_parameters")
        data["rope_theta"] = rope_params.pop("rope_theta")
        data["rope_scaling"] = None if rope_params["rope_type"] == "default" else rope_params
        (path / "config.json").write_text(json.dumps(data))
        reread = transformers.LlamaConfig.from_pretrained(str(path)).rope_parameters
        assert reread == {**model.config.rope_parameters}  # transformers reads it the same
    return model


def tokens(vocab, b=2, s=32):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def load_into(cfg: ModelConfig, weights) -> Transformer:
    """The plain mscale model holding ``weights(mscale_name)``."""
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights(name))
    return model.eval()


MODEL_OF = dict(name="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96,
                seq_len=256, norm_eps=1e-5)


@pytest.mark.parametrize("form", ["v5", "v4"])
@pytest.mark.parametrize("rope", [DEFAULT_500K, LLAMA3], ids=["theta500k", "llama3"])
def test_import_through_convert_matches_llama_for_causal_lm(tmp_path, rope, form):
    ref = save_llama(tmp_path / "hf", rope=rope, form=form)
    scaling = SCALING if rope["rope_type"] == "llama3" else None
    p = plan(model={**MODEL_OF, "vocab": 128, "rope_theta": rope["rope_theta"],
                    "rope_scaling": scaling})
    (tmp_path / "plan.yaml").write_text(dump_yaml(p))
    dst = str(tmp_path / "ckpt" / "step-000000")
    convert(str(tmp_path / "hf"), dst, plan=str(tmp_path / "plan.yaml"))
    from mscale.ckpt import catalog

    m = catalog.load_committed(dst)
    with CheckpointReader(dst, m) as r:
        mine = load_into(p.model, lambda n: r.read_full(tensor_key(MODEL, n)))
    x = tokens(128)
    with torch.no_grad():
        want, got = ref(x).logits, mine(x)
        plain = p.model.model_copy(update={"rope_theta": 10000.0, "rope_scaling": None})
        wrong = load_into(plain, lambda n: dict(mine.named_parameters())[n])(x)
    assert rel_err(got, want) < 1e-5
    assert rel_err(wrong, want) > 1e-2  # what ignoring rope_parameters used to give


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_tp_does_not_divide_is_padded_and_masked(tmp_path, tied):
    ref = save_llama(tmp_path, vocab=99, tie_word_embeddings=tied)
    config, tensors = open_hf(str(tmp_path))
    imported = hf_config.model_from_hf_config(config, str(tmp_path / "config.json"))
    model = {**MODEL_OF, "vocab": 100, "rope_theta": 500000.0, "tie_embeddings": tied}
    # a plan of 100 ids that does not say 99 are real would train the padding logit unmasked
    with pytest.raises(MscaleError) as e:
        hf.fit_to_plan(imported, plan(tp=2, model=model).model, 2, "config.json")
    assert e.value.field == "model.real_vocab" and "real_vocab: 99" in e.value.fix
    p = plan(tp=2, model={**model, "real_vocab": 99})
    cfg = hf.fit_to_plan(imported, p.model, 2, str(tmp_path / "config.json"))
    assert (cfg.vocab, cfg.real_vocab, cfg.name) == (100, 99, "llama")
    mine = load_into(cfg, lambda n: hf.pad_vocab_rows(n, tensors[hf.to_hf(n)], cfg))
    assert not mine.embed.weight[99:].any()
    x = tokens(99)
    labels = tokens(99, s=32).roll(1, dims=1)
    with torch.no_grad():
        out = ref(x, labels=labels)
        got = mine(x)
        assert rel_err(got[..., :99], out.logits) < 1e-5
        assert (got[..., 99:] == torch.finfo(got.dtype).min).all()
        want_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 99),
                                                      labels.reshape(-1))
        torch.testing.assert_close(mine(x, labels), want_loss, rtol=1e-5, atol=0)


def test_export_with_llama3_scaling_loads_in_transformers(tmp_path):
    p = plan(model={**MODEL_OF, "vocab": 128, "rope_theta": 10000.0,
                    "rope_scaling": SCALING})
    model = Transformer(p.model)
    init_weights(model, seed=3)
    with torch.no_grad():  # larger weights than the init, so the rotary angles matter
        for t in model.parameters():
            t.mul_(10 if t.dim() > 1 else 1)
    weights = {tensor_key(MODEL, n): t.detach() for n, t in model.named_parameters()}
    src = str(tmp_path / "run" / "ckpt" / "step-000005")
    write_synthetic(src, p, weights)
    convert(src, str(tmp_path / "hf"), to_hf=True)
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert ref.config.rope_parameters == LLAMA3
    x = tokens(128)
    with torch.no_grad():
        assert rel_err(model(x), ref(x).logits) < 1e-5
    config, _ = open_hf(str(tmp_path / "hf"))
    del config["mscale_model"]  # the LLaMA fields alone describe the same model
    assert hf_config.model_from_hf_config(config, "x").model_dump(exclude={"name"}) == \
        p.model.model_dump(exclude={"name"})


def llama_json(tmp_path, **kwargs) -> dict:
    transformers.LlamaConfig(vocab_size=128, **{**SHAPE, **kwargs}).save_pretrained(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text())


REFUSED = [
    (dict(hidden_act="gelu"), {}, "hidden_act"),
    (dict(hidden_act="relu"), {}, "hidden_act"),
    (dict(attention_bias=True), {}, "attention_bias"),
    (dict(mlp_bias=True), {}, "mlp_bias"),
    (dict(attention_dropout=0.1), {}, "attention_dropout"),
    (dict(head_dim=32), {}, "head_dim"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), {}, "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), {},
     "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                           "original_max_position_embeddings": 128}), {},
     "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), {},
     "rope_parameters.partial_rotary_factor"),
    ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.factor"),
    ({}, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                              "low_freq_factor": 1.0, "original_max_position_embeddings": 32}},
     "rope_parameters.high_freq_factor"),
    ({}, {"rope_parameters": None, "rope_theta": 5e5,
          "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({}, {"rope_scaling": {"rope_type": "default", "rope_theta": 1.0}}, "rope_parameters"),
    ({}, {"rope_theta": 123.0}, "rope_parameters.rope_theta"),
    ({}, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({}, {"model_type": "mistral"}, "model_type"),
    ({}, {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({}, {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({}, {"vocab_size": None}, "vocab_size"),
    ({}, {"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({}, {"intermediate_size": 0}, "intermediate_size"),
    ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}},
     "rope_parameters.rope_theta"),
    ({}, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                              "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                              "original_max_position_embeddings": 32}}, "rope_parameters"),
]


@pytest.mark.parametrize("made_with,edit,field", REFUSED,
                         ids=[f"{i}-{r[2]}" for i, r in enumerate(REFUSED)])
def test_unsupported_config_values_are_refused_by_their_hf_name(tmp_path, made_with, edit, field):
    data = {**llama_json(tmp_path, **made_with), **edit}
    with pytest.raises(MscaleError) as e:
        hf_config.model_from_hf_config(data, "hf/config.json")
    assert e.value.file == "hf/config.json"
    assert e.value.field == field or e.value.field.startswith(field + ".")


def test_a_plain_transformers_config_is_accepted_with_its_defaults(tmp_path):
    cfg = hf_config.model_from_hf_config(llama_json(tmp_path, rms_norm_eps=1e-6), "c")
    assert (cfg.rope_theta, cfg.norm_eps, cfg.kv_heads, cfg.rope_scaling) == (1e4, 1e-6, 2, None)


def test_a_different_plan_is_refused_naming_every_differing_field(tmp_path):
    imported = hf_config.model_from_hf_config(llama_json(tmp_path), "hf/config.json")
    other = imported.model_copy(update={"layers": 4, "rope_theta": 5e5, "name": "x"})
    assert hf.diff_model(imported, other) == ["layers", "rope_theta"]
    assert hf.diff_model(imported, imported.model_copy(update={"name": "y"})) == []
    with pytest.raises(MscaleError) as e:
        hf.fit_to_plan(imported, other, 1, "hf/config.json")
    assert e.value.field == "model.layers, model.rope_theta"
    assert "layers: 2 in config.json, 4 in the plan" in e.value.message


@pytest.mark.parametrize("edit,field", [
    ({"head_dim": "16" * 40}, "head_dim"), ({"head_dim": 16.5}, "head_dim"),
    ({"num_attention_heads": 10**400}, "head_dim"),
    ({"rope_parameters": {"rope_type": ["llama3"]}}, "rope_parameters.rope_type"),
    ({"rope_parameters": [1, 2]}, "rope_parameters"),
    ({"hidden_act": "x" * 100_000}, "hidden_act"),
])
def test_hostile_values_are_refused_without_a_traceback(tmp_path, edit, field):
    data = {**llama_json(tmp_path), **edit}
    with pytest.raises(MscaleError) as e:
        hf_config.model_from_hf_config(data, "c")
    assert e.value.field == field and len(str(e.value)) < 500
    with pytest.raises(MscaleError, match="JSON object"):
        hf_config.model_from_hf_config([data], "c")
@pytest.mark.parametrize("tied", [False, True])
def test_import_pads_for_tp_and_export_strips(tmp_path, tied):
    from mscale.ckpt import catalog

    ref = save_llama(tmp_path / "hf", vocab=99, tie_word_embeddings=tied)
    p = plan(tp=2, model={**MODEL_OF, "vocab": 100, "real_vocab": 99,
                          "rope_theta": 500000.0, "tie_embeddings": tied})
    (tmp_path / "plan.yaml").write_text(dump_yaml(p))
    dst = str(tmp_path / "run" / "ckpt" / "step-000000")
    convert(str(tmp_path / "hf"), dst, plan=str(tmp_path / "plan.yaml"))
    m = catalog.load_committed(dst)
    cfg = ModelConfig.model_validate(m.plan["model"])
    assert (cfg.vocab, cfg.real_vocab) == (100, 99)
    with CheckpointReader(dst, m) as r:
        mine = load_into(cfg, lambda n: r.read_full(tensor_key(MODEL, n)))
    x = tokens(99)
    with torch.no_grad():
        want, got = ref(x).logits, mine(x)
    assert rel_err(got[..., :99], want) < 1e-5
    convert(dst, str(tmp_path / "out"), to_hf=True)
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert back.config.vocab_size == 99
    with torch.no_grad():
        assert rel_err(back(x).logits, want) < 1e-6


def test_import_into_a_different_plan_names_the_fields(tmp_path):
    save_llama(tmp_path / "hf", vocab=99)
    p = plan(tp=2, model={**MODEL_OF, "vocab": 100, "real_vocab": 99, "layers": 4,
                          "rope_theta": 10000.0})
    (tmp_path / "plan.yaml").write_text(dump_yaml(p))
    with pytest.raises(MscaleError) as e:
        convert(str(tmp_path / "hf"), str(tmp_path / "c"), plan=str(tmp_path / "plan.yaml"))
    assert e.value.field == "model.layers, model.rope_theta"
