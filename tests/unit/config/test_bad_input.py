"""Hostile or mistaken config input: every case is one MscaleError (exit 3) naming the file and,
where there is one, the field, with a fix; never a traceback, a hang or a silent acceptance."""

from __future__ import annotations

import contextlib
import os
import tracemalloc

import pytest

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig, load_plan
from mscale.config import files as config_files
from mscale.config.base import dump_yaml, load_model, parse_yaml, read_text
from mscale.config.json_reader import parse_json
from mscale.config.layout import LayoutConfig
from mscale.errors import EXIT_BAD_INPUT, MscaleError

from tests.conftest import PLANS

TRAINING = "global_batch: 16\n"
CLUSTER = "nodes: 2\ngpus_per_node: 4\ngpu: A100\n"
MODEL = "layers: 4\nhidden: 64\nheads: 4\nvocab: 256\nseq_len: 64\n"


def refused(schema, tmp_path, text: str | bytes, name: str = "c.yaml") -> MscaleError:
    f = tmp_path / name
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(MscaleError) as e:
        load_model(schema, f)
    err = e.value
    assert err.code == EXIT_BAD_INPUT and err.file == str(f) and err.fix
    return err


# -- 1. files that are not UTF-8 YAML, cannot be read, or never end -----------------------------
@pytest.mark.parametrize("data, what", [
    ("global_batch: 16\n".encode("utf-16"), "UTF-16 text"),
    ("global_batch: 16\n".encode("utf-16-le"), "UTF-16 text"),
    ("global_batch: 16\n".encode("utf-32"), "UTF-32 text"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00" + bytes(range(256)), "binary data"),
    (b"global_batch: 16\nname: caf\xe9\n", "binary data"),
])
def test_non_utf8_files_are_named_as_such(tmp_path, data, what):
    err = refused(TrainingConfig, tmp_path, data)
    assert what in err.message and "UTF-8" in err.fix


@pytest.mark.parametrize("text, kind", [("- nodes: 4\n- gpu: A100\n", "list"),
                                        ("A100\n", "string"), ("4\n", "number")])
def test_a_file_that_is_not_a_mapping_is_told_what_to_be(tmp_path, text, kind):
    """Its fix said 'correct the field', of a file that has none."""
    err = refused(ClusterConfig, tmp_path, text)
    assert err.message == f"expected a mapping of fields, found a {kind}"
    assert err.fix.startswith("write one `field: value` per line")


def test_unreadable_file(tmp_path, monkeypatch):
    f = tmp_path / "plan.yaml"
    f.write_text(TRAINING)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(config_files.os, "open", denied)  # root reads mode 000 files anyway
    with pytest.raises(MscaleError, match="permission denied") as e:
        read_text(f)
    assert e.value.file == str(f) and "chmod" in e.value.fix


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
def test_mode_000_file(tmp_path):
    f = tmp_path / "plan.yaml"
    f.write_text(TRAINING)
    f.chmod(0)
    with pytest.raises(MscaleError, match="permission denied"):
        read_text(f)


def test_fifo_without_writer_gives_up(tmp_path, monkeypatch):
    monkeypatch.setattr(config_files, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    with pytest.raises(MscaleError, match="nothing arrived") as e:
        read_text(fifo)
    assert e.value.file == str(fifo) and "regular file" in e.value.fix


def test_huge_file_is_refused_before_reading(tmp_path, monkeypatch):
    f = tmp_path / "plan.yaml"
    with open(f, "wb") as fh:
        fh.truncate(2 << 30)  # sparse: 2 GB that take no disk

    def no_read(*_a, **_k):
        raise AssertionError("the file was opened for reading: its size should refuse it first")

    monkeypatch.setattr(config_files.os, "fdopen", no_read)
    with pytest.raises(MscaleError, match="too large") as e:
        read_text(f)
    assert e.value.file == str(f)


@contextlib.contextmanager
def peak_memory():
    """Yields a list that holds, once the block ends, the peak memory Python allocated in it: a
    bound on the block's work that does not depend on how loaded the machine is (a wall-clock
    limit does)."""
    got: list[int] = []
    tracemalloc.start()
    try:
        yield got
    finally:
        got.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_endless_device_is_bounded():
    with pytest.raises(MscaleError, match="too large"):
        read_text("/dev/zero", limit=1 << 20)


def test_fsspec_urls_get_the_same_checks(tmp_path):
    import fsspec

    with fsspec.open("memory://h1/bin.yaml", "wb") as f:
        f.write("lr: 1\n".encode("utf-16"))
    for url, message in (("memory://h1/bin.yaml", "UTF-16"), ("foo://x/plan.yaml", "protocol"),
                         ("memory://nowhere/x.yaml", "file not found"),
                         (str(tmp_path), "is a directory")):
        with pytest.raises(MscaleError, match=message) as e:
            read_text(url)
        assert e.value.file == url


@pytest.mark.parametrize("text, message", [
    ("{\"a\": NaN}", "non-finite"), ("{\"a\": -Infinity}", "non-finite"),
    ("{\"a\": 1,}", "not valid JSON"), ("[" * 100_000 + "]" * 100_000, "nests 100000 levels"),
    ("[" * 65 + "]" * 65, "nests 65 levels deep"), ("[" * 64 + "]" * 64, None),
    ("{\"a\": 1" + "0" * 5000 + "}", "5001 digits"), ("{\"a\": 1" + "0" * 20 + "}", "21 digits"),
    ("{\"a\": 1e999}", "non-finite"),
])
def test_json_configs(text, message):
    if message is None:  # at the bound: read
        assert parse_json(text.encode(), "hf/config.json") is not None
        return
    with pytest.raises(MscaleError, match=message) as e:
        parse_json(text.encode(), "hf/config.json")
    assert e.value.file == "hf/config.json" and e.value.code == 3


def test_json_reader_takes_the_callers_name_code_and_fix():
    """One reader for configs and checkpoints: a manifest's failure is exit 2 with its fix."""
    with pytest.raises(MscaleError) as e:
        parse_json(b'{"step": 1,}', "ck/manifest.json", what="manifest", code=2, fix="use another")
    err = e.value
    assert (err.code, err.fix, err.field) == (2, "use another", "line 1, column 12")
    assert err.message.startswith("manifest is not valid JSON")
    with pytest.raises(MscaleError, match="too large") as e:
        parse_json(b"[1, 2, 3]", "x.json", max_bytes=4)


def test_json_config_bytes_must_be_utf8(tmp_path):
    with pytest.raises(MscaleError, match="UTF-16"):
        parse_json('{"hidden_size": 64}'.encode("utf-16"), "config.json")
    bom = b"\xef\xbb\xbf"  # UTF-8 with a byte-order mark is still UTF-8
    assert parse_json(bom + b'{"hidden_size": 64}', "config.json") == {"hidden_size": 64}
    f = tmp_path / "t.yaml"
    f.write_bytes(bom + TRAINING.encode())
    assert load_model(TrainingConfig, f).global_batch == 16


# -- 2. YAML aliases ------------------------------------------------------------------------------
BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10))


def test_billion_laughs_in_a_plan_estimate_fails_fast(tmp_path):
    text = (PLANS / "cpu-tiny.yaml").read_text() + "estimate:\n" + "".join(
        "  " + line + "\n" for line in BOMB.splitlines())
    f = tmp_path / "plan.yaml"
    f.write_text(text)
    with peak_memory() as peak, pytest.raises(MscaleError, match="alias") as e:
        load_plan(str(f))
    assert e.value.file == str(f) and peak[0] < 16 << 20  # expanded, it is 10^10 list entries
    big = load_plan(str(PLANS / "gpt-175b-a100-12288.yaml"))  # what mscale writes still loads
    f.write_text(dump_yaml(big))
    assert load_plan(str(f)).cluster.world_size == 12288


def test_recursive_alias_is_refused_modest_ones_work():
    with pytest.raises(MscaleError, match="alias"):
        parse_yaml("a: &a [*a, *a]\n", "x.yaml")
    data = parse_yaml("base: &b {lr: 1.0e-4, steps: 5}\nrun:\n  <<: *b\n  steps: 7\n", "x.yaml")
    assert data["run"] == {"lr": 1e-4, "steps": 7}


def test_repeated_keys_are_refused(tmp_path):
    err = refused(TrainingConfig, tmp_path, "global_batch: 16\nlr: 1.0e-3\nlr: 1.0\n")
    assert err.field == "lr" and "twice" in err.message and "line 3" in err.message


# -- 3. numbers -----------------------------------------------------------------------------------
@pytest.mark.parametrize("schema, base, extra, field", [
    (TrainingConfig, TRAINING, "lr: .inf", "lr"),
    (TrainingConfig, TRAINING, "beta1: .nan", "beta1"),
    (TrainingConfig, TRAINING, "lr: 1e999", "lr"),
    (TrainingConfig, TRAINING, "lr: !!float inf", "lr"),
    (TrainingConfig, "", "global_batch: 1" + "0" * 5000, "global_batch"),
    (TrainingConfig, TRAINING, "beta2: -1", "beta2"),
    (TrainingConfig, TRAINING, "beta1: 1.0", "beta1"),
    (TrainingConfig, TRAINING, "eps: 0", "eps"),
    (TrainingConfig, TRAINING, "min_lr: 1.0\nlr: 0.1", "min_lr"),
    (TrainingConfig, "", "global_batch: true", "global_batch"),
    (TrainingConfig, "", "global_batch: 16.0", "global_batch"),
    (TrainingConfig, "", "global_batch: '16'", "global_batch"),
    (TrainingConfig, TRAINING, "zero_stage: true", "zero_stage"),
    (TrainingConfig, TRAINING, "micro_batch: 32", "micro_batch"),
    (TrainingConfig, TRAINING, "seed: -1", "seed"),
    (TrainingConfig, TRAINING, "data: {kind: tokens}", "data.path"),
    (TrainingConfig, TRAINING, "estimate: {x: .inf}", "estimate.x"),
    (ClusterConfig, CLUSTER, "nic_gbit_per_s: .inf", "nic_gbit_per_s"),
    (ClusterConfig, "gpu: A100\n", "nodes: 1000000000000", "nodes"),
    (ClusterConfig, "gpu: A100\n", "nodes: 200000", "nodes"),
    (ClusterConfig, "gpu: A100\n", "hostlist: n[1-4]\nnodes: 3", "nodes"),
    (ClusterConfig, "gpu: A100\n", "hostlist: n[1-", "hostlist"),
    (ClusterConfig, "nodes: 2\n", "gpu: {name: X, peak_tflops: 1, memory_gb: 80, "
     "nvlink_gb_per_s: .inf}", "gpu.nvlink_gb_per_s"),
    (ClusterConfig, "nodes: 2\n", "gpu: {name: X, peak_tflops: 1, memory_gb: 1e9, "
     "nvlink_gb_per_s: 600}", "gpu.memory_gb"),
    (ClusterConfig, CLUSTER, "fast_domain_size: 3", "fast_domain_size"),
    (ModelConfig, MODEL.replace("layers: 4\n", ""), "layers: true", "layers"),
    (LayoutConfig, "", "tp: true", "tp"),
    (LayoutConfig, "", "zero_stage: 1.0", "zero_stage"),
])
def test_numbers_need_the_right_type_bounds_and_finiteness(tmp_path, schema, base, extra, field):
    text = base + extra + "\n"
    if "estimate" in extra:  # a free-form section: only the loader can see a bad number
        with pytest.raises(MscaleError, match="non-finite") as e:
            parse_yaml(text, "t.yaml")
        assert e.value.field == field
        return
    err = refused(schema, tmp_path, text)
    assert err.field == field, err
    assert not err.message.startswith(field)  # the field is printed once, by MscaleError


def test_strict_types_keep_every_number_yaml_users_write(tmp_path):
    """``true`` is no longer 1, yet ``1e-4`` (a string to YAML 1.1) and ints for floats still
    read as numbers, and every bundled file still loads."""
    refused(TrainingConfig, tmp_path, "global_batch: true\n")
    f = tmp_path / "t.yaml"
    f.write_text(TRAINING + "lr: 1e-4\nmin_lr: 1E-5\neps: 1e-8\nweight_decay: 1e-1\n")
    tr = load_model(TrainingConfig, f)
    assert (tr.lr, tr.min_lr, tr.eps, tr.weight_decay) == (1e-4, 1e-5, 1e-8, 0.1)
    f.write_text(CLUSTER + "nic_gbit_per_s: 400\n")
    assert load_model(ClusterConfig, f).nic_gbit_per_s == 400.0
    for kind, schema in (("clusters", ClusterConfig), ("models", ModelConfig),
                         ("training", TrainingConfig)):
        for f in sorted((PLANS / kind).glob("*.yaml")):
            load_model(schema, f)
    presets = PLANS.parent / "src" / "mscale" / "presets"
    for f in sorted(PLANS.glob("*.yaml")) + sorted(presets.glob("*.yaml")):
        load_plan(str(f))


def test_more_pipeline_stages_than_layers_is_refused_before_splitting():
    from mscale.config.layout import check_layout

    model = ModelConfig(layers=4, hidden=64, heads=4, vocab=256, seq_len=64)
    layout = LayoutConfig(pp=1 << 20, vpp=1 << 20, dp=1)  # 2^40 stages: never build that list
    with peak_memory() as peak, pytest.raises(MscaleError, match="stages") as e:
        check_layout(layout, model, TrainingConfig(global_batch=16), None, source="p.yaml")
    assert e.value.field == "layout.pp" and peak[0] < 1 << 20  # a 2^40-entry list never built


# -- 5. error texts -------------------------------------------------------------------------------
def test_several_errors_name_each_field_once(tmp_path):
    err = refused(TrainingConfig, tmp_path, "global_batch: 0\nmicro_batch: -1\nlr: 0\n")
    text = str(err)
    assert err.field == "global_batch"
    assert "global_batch: global_batch" not in text and text.count("micro_batch") == 1
    assert "also micro_batch: " in text and "docs/config-reference.md" in err.fix


def test_model_validator_errors_name_the_field_not_the_model(tmp_path):
    err = refused(ClusterConfig, tmp_path, "gpu: A100\n")
    assert err.field == "nodes" and "Value error" not in err.message
    err = refused(TrainingConfig, tmp_path, TRAINING + "data:\n  kind: tokens\n")
    assert err.field == "data.path" and not err.message.startswith("data")


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("just text\n", "string")])
def test_a_file_that_is_not_a_mapping(tmp_path, text, kind):
    err = refused(TrainingConfig, tmp_path, text)
    assert f"found a {kind}" in err.message


# -- 6. contradictions between fields (user trial) ------------------------------------------------
@pytest.mark.parametrize("extra, field, fix", [
    ("steps: 10\nwarmup_steps: 20", "warmup_steps", "at most steps"),
    ("lr: 1.0e-4\nmin_lr: 1.0e-3", "min_lr", "at most lr"),
])
def test_training_contradictions_name_the_field_and_the_fix(tmp_path, extra, field, fix):
    err = refused(TrainingConfig, tmp_path, TRAINING + extra + "\n")
    assert err.field == field and fix in err.fix


@pytest.mark.parametrize("data", [
    "{path: null, shuffle: true, eval_fraction: 0.05}",  # a template's blank variable
    "{sources: []}",
    "{eval_fraction: 0.1}",
    "{dtype: uint32}",
])
def test_a_data_section_without_a_source_is_refused_not_trained_on_synthetic_tokens(tmp_path,
                                                                                 data):
    """Each of these used to train on the synthetic stream and exit 0 (helper-42's trial)."""
    err = refused(TrainingConfig, tmp_path, TRAINING + f"data: {data}\n")
    assert err.field == "data.path" and "needs a path or sources" in err.message


def test_no_data_section_or_shuffle_alone_is_the_synthetic_stream(tmp_path):
    for text in (TRAINING, TRAINING + "data: {shuffle: false}\n", TRAINING + "data: {}\n"):
        f = tmp_path / "t.yaml"
        f.write_text(text)
        assert load_model(TrainingConfig, f).data.kind == "synthetic"


def test_a_contradiction_with_a_default_says_the_field_was_not_set(tmp_path):
    """Leaving lr out gave 'min_lr 0.0005 is above lr (0.0003)', a value the user never wrote
    (helper-42's trial)."""
    err = refused(TrainingConfig, tmp_path, TRAINING + "min_lr: 5.0e-4\n")
    assert err.field == "min_lr" and "the default: lr is not set" in err.message
    err = refused(TrainingConfig, tmp_path, TRAINING + "lr: 1.0e-4\nmin_lr: 5.0e-4\n")
    assert "not set" not in err.message


def test_warmup_as_long_as_the_run_is_allowed_and_the_default_fits_a_short_run(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text(TRAINING + "steps: 10\nwarmup_steps: 10\n")
    assert load_model(TrainingConfig, f).warmup_steps == 10
    short = TrainingConfig(global_batch=16, steps=4)  # warmup_steps left out: 10, cut to the run
    assert short.warmup_steps == 4
    assert TrainingConfig(global_batch=16, steps=40).warmup_steps == 10
    with pytest.raises(ValueError, match="more than steps"):  # assignment is checked too
        TrainingConfig(global_batch=16, steps=40, warmup_steps=20).steps = 10


def test_a_plan_names_training_warmup_steps(tmp_path):
    text = (PLANS / "cpu-tiny.yaml").read_text().replace("warmup_steps: 4", "warmup_steps: 400")
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(MscaleError) as e:
        load_plan(str(f))
    assert e.value.field == "training.warmup_steps" and e.value.code == EXIT_BAD_INPUT


@pytest.mark.parametrize("item, field", [
    ("{path: /b, weight: -1}", "data.sources[1].weight"),
    ("{path: ''}", "data.sources[1].path"),
    ("{path: /b, wieght: 1}", "data.sources[1].wieght"),
])
def test_list_items_are_named_by_index_in_brackets(tmp_path, item, field):
    """One spelling for list items, pydantic's errors as the YAML loader's: ``sources[1]``."""
    err = refused(TrainingConfig, tmp_path, TRAINING + f"data:\n  sources:\n    - {{path: /a}}\n"
                                                       f"    - {item}\n")
    assert err.field == field


def test_field_path_spelling():
    from mscale.config.base import field_path

    assert field_path("training", "data", "sources", 1, "path") == "training.data.sources[1].path"
    assert field_path("", "stage_layers", 0) == "stage_layers[0]"
    assert field_path("layout", "eval.interval") == "layout.eval.interval"
    assert field_path() == ""


@pytest.mark.parametrize("schema, text, field, near", [
    (ClusterConfig, "nodes: 2\ngpu_per_node: 4\ngpu: A100\n", "gpu_per_node", "gpus_per_node"),
    (TrainingConfig, TRAINING + "data:\n  kind: tokens\n  sources:\n  - path: /x\n    wieght: 2\n",
     "data.sources[0].wieght", "weight"),
    (TrainingConfig, TRAINING + "colour: 1\n", "colour", None),  # nothing close: no guess
])
def test_an_unknown_field_names_the_known_one_it_is_closest_to(tmp_path, schema, text, field,
                                                                near):
    err = refused(schema, tmp_path, text)
    assert err.field == field
    assert err.message == (f"unknown field (a typo of {near}?)" if near else
                           "unknown field (a typo?)")
