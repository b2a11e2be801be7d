import pytest

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig, load_plan
from mscale.config.base import load_model
from mscale.config.layout import LayoutConfig, check_layout, even_split
from mscale.errors import MscaleError

from tests.conftest import PLANS


def test_gpu_presets_use_dense_peaks():
    c = ClusterConfig(nodes=2, gpu="h800")
    assert c.gpu.peak_tflops == 989  # never the 1,979 sparse figure
    assert ClusterConfig(nodes=1, gpu="A100").gpu.peak_tflops == 312
    assert c.world_size == 16 and c.domain_size == 8


def test_hostlist_sets_and_checks_node_count():
    assert ClusterConfig(hostlist="n[001-004,007]", gpu="H100").num_nodes == 5
    with pytest.raises(ValueError, match="names 5 nodes but nodes is 4"):
        ClusterConfig(hostlist="n[001-004,007]", nodes=4, gpu="H100")


def test_hostlist_blanks_separate_nodes_as_in_slurm():
    """``node1, node2`` named a node `` node2`` that no launcher reports and no --exclude
    matched; SLURM reads blanks as separators."""
    c = ClusterConfig(hostlist="node1, node2  node[3-4]\tgpu-x", gpu="H100")
    assert c.node_names() == ["node1", "node2", "node3", "node4", "gpu-x"]
    assert c.num_nodes == 5


@pytest.mark.parametrize("hostlist, says", [
    ("node[1-4],node2", "names node2 more than once"),
    ("n[1-3] n[2-3]", "names n2, n3 more than once"),
    (" ", "names no node"),
    (",", "names no node"),
])
def test_hostlist_naming_a_node_twice_or_none_is_refused(hostlist, says):
    """A repeated node used to be dropped silently: one node fewer than written, and a
    ``nodes:`` counting what was written told it disagreed."""
    with pytest.raises(ValueError, match=says):
        ClusterConfig(hostlist=hostlist, gpu="H100")


def test_unknown_field_names_file_and_field(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("layers: 2\nhidden: 64\nheads: 4\nvocab: 10\nseq_len: 8\nhiden: 3\n")
    with pytest.raises(MscaleError) as e:
        load_model(ModelConfig, f)
    assert e.value.file == str(f) and e.value.field == "hiden" and "typo" in str(e.value)


def test_yaml_syntax_error_names_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("layers: 2\n  hidden: [\n")
    with pytest.raises(MscaleError) as e:
        load_model(ModelConfig, f)
    assert "line" in e.value.field


def test_yaml_is_loaded_safely(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text("layers: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(MscaleError):
        load_model(ModelConfig, f)


def test_model_parameter_count_gpt_style():
    # GPT-3 175B shape with a 4h GeLU MLP and no biases: 12·l·h² + 2·V·h + norms.
    m = ModelConfig(layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048, mlp="gelu",
                    ffn_hidden=4 * 12288)
    expected = 96 * (12 * 12288**2 + 2 * 12288) + 2 * 50257 * 12288 + 12288
    assert m.num_parameters() == expected


def test_even_split_gives_remainder_to_middle():
    assert even_split(10, 4) == [2, 3, 3, 2]
    assert even_split(8, 4) == [2, 2, 2, 2]
    assert sum(even_split(97, 8)) == 97


def _even_split_by_sorting(layers: int, stages: int) -> list[int]:
    """The rule as first written: stages sorted by (is an end, distance from the centre)."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - (stages - 1) / 2)))
    for i in order[:extra]:
        counts[i] += 1
    return counts


def test_even_split_window_matches_the_sorted_rule():
    for stages in range(1, 70):
        for layers in range(0, 3 * stages + 3):
            assert even_split(layers, stages) == _even_split_by_sorting(layers, stages), (
                layers, stages)


def _layout_error(**kw):
    model = ModelConfig(layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=64)
    training = TrainingConfig(global_batch=16)
    with pytest.raises(MscaleError) as e:
        check_layout(LayoutConfig(**kw), model, training, None, source="p.yaml")
    return e.value


def test_layout_errors_name_field_and_fix():
    e = _layout_error(tp=3)
    assert e.field == "layout.tp" and e.fix and e.code == 3
    assert _layout_error(tp=4).field == "layout.tp"  # kv_heads=2
    assert _layout_error(pp=2, dp=1, micro_batch=16).field == "layout.micro_batch"  # m=1 < pp
    assert _layout_error(stage_layers=[1, 1]).field == "layout.stage_layers"


def test_only_the_end_stages_may_be_empty():
    """4 layers, pp 2 × vpp 2: empty ends carry the embedding and the head; an empty middle
    stage would only pass tensors on."""
    model = ModelConfig(layers=4, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=64)
    ok = LayoutConfig(pp=2, vpp=2, stage_layers=[0, 2, 2, 0])
    check_layout(ok, model, TrainingConfig(global_batch=16), None)
    e = _layout_error(pp=2, vpp=2, stage_layers=[1, 0, 3, 0])
    assert e.field == "layout.stage_layers" and "middle stage 1" in str(e)
    assert "sum to 5" in str(_layout_error(pp=2, vpp=2, stage_layers=[1, 2, 2, 0]))


def test_bundled_plan_loads():
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    assert plan.layout.world_size == plan.cluster.world_size == 8


def _fifo_with(tmp_path, name: str, text: str):
    """A named pipe (non-seekable, like /dev/stdin) that yields ``text`` once to one reader."""
    import os
    import threading

    fifo = tmp_path / name
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:
            f.write(text)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return fifo, t


def test_read_text_reads_non_seekable_local_files(tmp_path):
    from mscale.config.base import read_text

    fifo, t = _fifo_with(tmp_path, "pipe.yaml", "layers: 2\n")
    assert read_text(str(fifo)) == "layers: 2\n"
    t.join(timeout=5)
    with pytest.raises(MscaleError, match="file not found"):
        read_text(tmp_path / "missing.yaml")


def test_a_partial_last_pod_is_a_valid_cluster():
    """Real clusters end in a partial pod (plan validation's Llama 3 runs: 1,024 and 2,048 nodes in
    pods of 384); the planner prices it (tests/unit/planner/test_comm.py)."""
    c = ClusterConfig(nodes=4, nodes_per_pod=3, gpu="A100")
    assert c.pod_nodes == 3 and c.num_nodes == 4


def test_a_world_mismatch_shows_each_factor_and_which_were_left_unset():
    """Removing layout.tp gave 'layout.dp: tp·pp·dp = 4', naming dp and not the missing tp
    (helper-42's trial)."""
    model = ModelConfig(layers=4, hidden=64, heads=4, vocab=256, seq_len=64)
    cluster = ClusterConfig(nodes=4, gpus_per_node=2, gpu="cpu")
    with pytest.raises(MscaleError) as e:
        check_layout(LayoutConfig(pp=2, dp=2), model, TrainingConfig(global_batch=16), cluster,
                     source="p.yaml")
    assert "1·2·2 = 4" in e.value.message and "(tp not set: 1)" in e.value.message
