"""The search: validity of every candidate, restrictions, ranking and rejection reasons."""

import pytest

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig, check_layout
from mscale.config.base import load_model
from mscale.planner.cost import Problem, evaluate
from mscale.planner.search import search

from tests.conftest import PLANS


def cpu_problem(**training) -> Problem:
    tr = load_model(TrainingConfig, PLANS / "training" / "cpu-demo.yaml")
    return Problem(load_model(ModelConfig, PLANS / "models" / "tiny.yaml"),
                   tr.model_copy(update=training),
                   load_model(ClusterConfig, PLANS / "clusters" / "cpu-4x2.yaml"))


def test_every_result_passes_check_layout_and_matches_evaluate():
    pb = cpu_problem(micro_batch=None, zero_stage=None, recompute=None)
    r = search(pb)
    assert r.count > 10
    steps = [r.cost(i).step_time for i in range(r.count)]
    assert steps == sorted(steps)
    for i in range(r.count):
        lo = r.layout(i)
        check_layout(lo, pb.model, pb.training, pb.cluster)
        assert evaluate(pb, lo).step_time == pytest.approx(steps[i])
        assert r.cost(i).fits


def test_training_fields_restrict_the_search():
    r = search(cpu_problem())  # cpu-demo fixes micro_batch 2, zero 1, recompute none
    assert r.count > 0
    assert {r.layout(i).micro_batch for i in range(r.count)} == {2}
    assert {r.layout(i).recompute for i in range(r.count)} == {"none"}
    assert {r.layout(i).zero_stage for i in range(r.count) if r.layout(i).dp > 1} == {1}


def test_tp_must_divide_kv_heads_and_stay_in_the_node():
    r = search(cpu_problem(micro_batch=None))
    assert {r.layout(i).tp for i in range(r.count)} <= {1, 2}  # 2 GPUs per node, kv_heads 2


def test_uneven_pipeline_split_is_searched():
    pb = Problem(ModelConfig(layers=5, hidden=64, heads=4, vocab=256, seq_len=64),
                 TrainingConfig(global_batch=16), ClusterConfig(nodes=2, gpus_per_node=2, gpu="cpu"))
    r = search(pb)
    assert any(r.layout(i).pp == 2 for i in range(r.count))  # 5 layers over 2 stages


def test_memory_rejections_are_grouped_with_the_least_needed():
    pb = Problem(ModelConfig(layers=8, hidden=1024, heads=8, vocab=32000, seq_len=2048),
                 TrainingConfig(global_batch=64), ClusterConfig(nodes=2, gpus_per_node=2, gpu="cpu"))
    r = search(pb)
    oom = {k: v for k, v in r.rejects.counts.items() if k.startswith("out of memory")}
    assert oom and all("least needs" in r.rejects.examples[k] for k in oom)


def test_megascale_175b_search_finds_layouts_beating_its_own():
    pb = Problem(load_model(ModelConfig, PLANS / "models" / "gpt-175b.yaml"),
                 load_model(TrainingConfig, PLANS / "training" / "gpt-175b.yaml"),
                 load_model(ClusterConfig, PLANS / "clusters" / "a100-12288.yaml"))
    r = search(pb)
    best = r.cost(0)
    assert best.fits and best.mem_total <= pb.budget_bytes
    theirs = LayoutConfig(tp=8, pp=8, dp=192, vpp=6, micro_batch=1, sequence_parallel=True,
                          zero_stage=2, recompute="none")
    check_layout(theirs, pb.model, pb.training, pb.cluster)
    mine = evaluate(pb, theirs)
    assert mine.fits
    assert best.step_time <= mine.step_time
    # the paper's layout stays competitive (docs/plan.md explains the 3.3-point gap: TP 8 vs 4 and
    # 32 small micro-batches for the DP overlap, not the interleaving)
    assert best.mfu - mine.mfu < 0.04
