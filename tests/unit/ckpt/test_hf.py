"""HF export/import: the safetensors format, LLaMA names, and logits of an independent LLaMA
implementation (written here from the HF modeling code's math) on the exported weights."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
import torch.nn.functional as F

from mscale.ckpt import catalog, hf, hf_config, safetensors
from mscale.ckpt.convert import convert, open_hf
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import MODEL, tensor_key
from mscale.config.model import ModelConfig
from mscale.errors import MscaleError
from tests.unit.ckpt.helpers import MODEL_CFG, global_state, plan, write_synthetic


def test_safetensors_round_trip_and_alignment():
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "c": torch.randn(2, 2).to(torch.bfloat16), "d": torch.zeros(0)}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    buf = io.BytesIO()
    safetensors.write(buf, entries, tensors.__getitem__, {"format": "pt"})
    (n,) = struct.unpack("<Q", buf.getvalue()[:8])
    assert (8 + n) % 8 == 0
    assert json.loads(buf.getvalue()[8: 8 + n])["a"]["dtype"] == "F32"
    entries, _, start = safetensors.read_header(buf, "mem")
    back = {e.name: safetensors.read_tensor(buf, e, start) for e in entries}
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("edit", ["gap", "overlap", "outside", "dtype", "huge"])
def test_bad_safetensors_headers_are_refused(edit):
    head = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    data = b"\0" * 12
    if edit == "gap":
        head["b"]["data_offsets"] = [9, 13]
    elif edit == "overlap":
        head["b"]["data_offsets"] = [4, 8]
    elif edit == "outside":
        data = b"\0" * 8
    elif edit == "dtype":
        head["a"]["dtype"] = "PICKLE"
    raw = json.dumps(head).encode()
    n = len(raw) if edit != "huge" else 1 << 40
    with pytest.raises(MscaleError):
        safetensors.read_header(io.BytesIO(struct.pack("<Q", n) + raw + data), "x")


@pytest.mark.parametrize("parallel", [False, True])
def test_names_round_trip(parallel):
    from mscale.ckpt.hf_io import _model_names

    cfg = ModelConfig(**MODEL_CFG, parallel_block=parallel)
    names = _model_names(cfg)
    hf_names = [hf.to_hf(n) for n in names]
    assert len(set(hf_names)) == len(names)
    assert [hf.from_hf(h, cfg) for h in hf_names] == names
    assert "model.layers.1.self_attn.q_proj.weight" in hf_names


def reference_llama(w: dict[str, torch.Tensor], c: dict, tokens: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's forward (eager attention), from the HF names and config.json only."""
    heads, kv, hidden = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    d, eps = hidden // heads, c["rms_norm_eps"]
    b, s = tokens.shape
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()

    def norm(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate_half(x):
        return torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)

    h = w["model.embed_tokens.weight"][tokens]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, s, heads, d).transpose(1, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, s, kv, d).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, s, kv, d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = F.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(b, s, hidden) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        up = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + up @ w[p + "mlp.down_proj.weight"].T
    return norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_export_matches_the_model_and_imports_back(tmp_path):
    from mscale.model import Transformer, init_weights

    p = plan(tp=2, dp=2)
    model = Transformer(p.model)
    init_weights(model, seed=3)
    weights = {tensor_key(MODEL, n): t.detach() for n, t in model.named_parameters()}
    src = str(tmp_path / "run" / "ckpt" / "step-000005")
    write_synthetic(src, p, weights)
    out = convert(src, str(tmp_path / "hf"), to_hf=True)
    assert out["tensors"] == len(weights)
    config, tensors = open_hf(str(tmp_path / "hf"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, p.model.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens)
    got = reference_llama(tensors, config, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and back, at another layout: a model-only checkpoint with exactly these weights
    back = tmp_path / "run2" / "ckpt" / "step-000000"
    plan_file = tmp_path / "plan.yaml"
    from mscale.config.base import dump_yaml

    plan_file.write_text(dump_yaml(plan(tp=4, pp=2)))
    convert(str(tmp_path / "hf"), str(back), plan=str(plan_file))
    assert catalog.read_latest(str(back.parent)) == "step-000000"
    m = catalog.load_committed(str(back))
    assert m.state.step == 0 and m.state.optimizer is None
    with CheckpointReader(str(back), m) as r:
        for k, v in weights.items():
            assert torch.equal(r.read_full(k), v)
    with pytest.raises(MscaleError, match="not empty"):
        convert(str(tmp_path / "hf"), str(back), plan=str(plan_file))


def test_padding_rows_added_on_import_are_stripped_on_export():
    cfg = ModelConfig(**{**MODEL_CFG, "vocab": 250})
    padded = hf.pad_vocab(cfg, hf.padded_vocab(250, 4, cfg))
    assert (padded.vocab, padded.real_vocab) == (252, 250)
    embed = torch.randn(250, 64)
    rows = hf.pad_vocab_rows("embed.weight", embed, padded)
    assert rows.shape == (252, 64) and not rows[250:].any() and torch.equal(rows[:250], embed)
    norm = torch.ones(64)
    assert torch.equal(hf.pad_vocab_rows("final_norm.weight", norm, padded), norm)
    assert torch.equal(hf.strip_vocab_rows("head.weight", rows, padded), embed)
    assert hf.hf_shape("head.weight", (252, 64), padded) == (250, 64)
    assert hf.hf_shape("layers.0.attn.wq.weight", (64, 64), padded) == (64, 64)
    exported = hf.hf_config(padded)
    assert exported["vocab_size"] == 250 and "real_vocab" not in exported["mscale_model"]
    assert hf_config.model_from_hf_config(exported, "c") == cfg


@pytest.mark.parametrize("vocab,tp,plan_vocab,plan_real,want", [
    (256, 4, 256, None, 256),   # TP divides it: no padding
    (250, 4, 256, None, 256),   # the plan's own padded size
    (250, 4, 250, None, 252),   # the next multiple of TP (the plan is then refused)
    (256, 4, 384, 256, 384),    # the plan names 256 as its real vocabulary
])
def test_padded_vocab_follows_the_plan(vocab, tp, plan_vocab, plan_real, want):
    plan_cfg = ModelConfig(**{**MODEL_CFG, "vocab": plan_vocab, "real_vocab": plan_real})
    assert hf.padded_vocab(vocab, tp, plan_cfg) == want


@pytest.mark.parametrize("rows", [(0, 100), (200, 252), (248, 252), (251, 252), (250, 252)])
def test_padded_region_reads_real_rows_and_zeros_beyond(rows):
    padded = ModelConfig(**{**MODEL_CFG, "vocab": 252, "real_vocab": 250})
    embed = torch.randn(250, 64)
    whole = torch.cat([embed, torch.zeros(2, 64)])
    box = [rows, (8, 24)]
    got = hf.padded_region("head.weight", embed, box, padded)
    assert torch.equal(got, whole[rows[0]: rows[1], 8:24])


def exported_hf(tmp_path):
    """The test plan's model weights, written as a step-1 checkpoint and exported to
    ``tmp_path/hf``: (plan, weights by checkpoint key)."""
    p = plan()
    weights = {k: v for k, v in global_state(p, optimizer=False).items()
               if k.startswith(f"{MODEL}/")}
    src = str(tmp_path / "run" / "ckpt" / "step-000001")
    write_synthetic(src, p, weights, step=1)
    convert(src, str(tmp_path / "hf"), to_hf=True)
    return p, weights


def test_import_trains_at_the_plans_seq_len_whatever_max_position_embeddings(tmp_path):
    """config.json's max_position_embeddings is the context the model supports (131,072 for
    Llama-3.1), not a training length: an import into a plan of a shorter seq_len was refused
    as "a different model" (model.seq_len), so no real LLaMA could be fine-tuned."""
    from mscale.config.base import dump_yaml

    p, weights = exported_hf(tmp_path)
    cfg_file = tmp_path / "hf" / "config.json"
    data = json.loads(cfg_file.read_text())
    data.pop("mscale_model")
    data["max_position_embeddings"] = 4096
    cfg_file.write_text(json.dumps(data))
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(dump_yaml(p))  # seq_len 32
    dst = tmp_path / "run2" / "ckpt" / "step-000000"
    convert(str(tmp_path / "hf"), str(dst), plan=str(plan_file))
    m = catalog.load_committed(str(dst))
    assert m.plan["model"]["seq_len"] == 32
    with CheckpointReader(str(dst), m) as r:
        for k, v in weights.items():
            assert torch.equal(r.read_full(k), v)
    other = p.model.model_copy(update={"layers": 3})  # a real difference is still refused
    with pytest.raises(MscaleError) as e:
        hf.fit_to_plan(hf_config.model_from_hf_config(data, "c"), other, 1, "c")
    assert e.value.field == "model.layers"


@pytest.mark.parametrize("weights, said", [
    (None, "no *.safetensors"), ("pytorch_model.bin", "pytorch_model.bin")])
def test_an_hf_folder_without_safetensors_is_named_as_one(tmp_path, weights, said):
    """Importing an HF folder whose weights are pickled (or missing) was refused with "convert
    it first: mscale ckpt convert SRC DST --plan PLAN": the command that had just been run."""
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text("{}")
    if weights:
        (src / weights).write_bytes(b"\x80\x02")
    for kw in ({"plan": str(tmp_path / "p.yaml")}, {"to_hf": True}):
        with pytest.raises(MscaleError) as e:
            convert(str(src), str(tmp_path / "out"), **kw)
        assert said in str(e.value) and "safe_serialization" in e.value.fix
        assert "convert it first" not in e.value.fix and not (tmp_path / "out").exists()


def test_a_tensor_in_two_safetensors_files_is_refused(tmp_path):
    """Every *.safetensors of the folder is read: a stale copy beside model.safetensors gave
    its (here zeroed) weights to the import, whichever sorted last, without a word."""
    exported_hf(tmp_path)
    data = (tmp_path / "hf" / "model.safetensors").read_bytes()
    n = 8 + struct.unpack("<Q", data[:8])[0]
    (tmp_path / "hf" / "zz-old.safetensors").write_bytes(data[:n] + bytes(len(data) - n))
    with pytest.raises(MscaleError) as e:
        open_hf(str(tmp_path / "hf"))
    assert e.value.file.endswith("zz-old.safetensors") and "model.safetensors" in str(e.value)


def test_missing_hf_weights_are_refused_before_the_start_line(tmp_path):
    """A missing weight (a shard of a sharded export not copied) was found while writing: the
    conversion had announced its start and written shards first."""
    from mscale.config.base import dump_yaml

    p, _ = exported_hf(tmp_path)
    _, tensors = open_hf(str(tmp_path / "hf"))
    kept = {k: v.clone() for k, v in tensors.items() if k not in ("lm_head.weight",
                                                                    "model.norm.weight")}
    del tensors
    with open(tmp_path / "hf" / "model.safetensors", "wb") as fh:
        safetensors.write(fh, [(k, v.dtype, tuple(v.shape)) for k, v in kept.items()],
                          kept.__getitem__)
    (tmp_path / "plan.yaml").write_text(dump_yaml(p))
    started = []
    with pytest.raises(MscaleError) as e:
        convert(str(tmp_path / "hf"), str(tmp_path / "out"), plan=str(tmp_path / "plan.yaml"),
                on_start=started.append)
    assert "lm_head.weight" in str(e.value) and "model.norm.weight" in str(e.value)
    assert started == [] and not (tmp_path / "out").exists()
