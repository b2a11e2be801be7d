"""Kernel time from the work: GEMM efficiency by shape against the H200 measurements, attention
and memory-bound work, and stack profiles."""

import dataclasses
import json
import statistics
import typing

import pytest

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig
from mscale.config.gpus import GPU_PRESETS
from mscale.config.training import Stack
from mscale.planner.cost import Problem, evaluate
from mscale.planner.kernels import Device, block_times, flash_efficiency, gemm_efficiency
from mscale.planner.stacks import STACKS

from tests.conftest import REPO as ROOT

H200 = Device.of(GPU_PRESETS["H200"])
A100 = Device.of(GPU_PRESETS["A100"])


def measured():
    doc = json.loads((ROOT / "bench" / "data" / "h200_kernels.json").read_text())
    return doc


def test_gemm_model_reproduces_the_h200_measurements():
    """The fit in constants.GEMM_MAX_EFFICIENCY: median |error| 2.5% over the GEMMs long enough
    (> 150 µs) for the host's launch time not to dominate the event-timed measurement."""
    rows = [g for g in measured()["gemm"] if g["op"] != "square" and g["s"] > 150e-6]
    assert len(rows) > 150
    errs = [abs(float(gemm_efficiency(H200, g["m"], g["n"], g["k"])) * 989 / g["tflops"] - 1)
            for g in rows]
    assert statistics.median(errs) < 0.035 and max(errs) < 0.45


def test_small_gemms_reach_less_of_the_peak():
    big = float(gemm_efficiency(A100, 2048, 4608, 12288))  # 175B QKV at tp 8
    short_k = float(gemm_efficiency(A100, 2048, 12288, 192))  # a short reduction
    # 128 × 15,360 output: 60 tiles of 128×256 or 120 of 256×128 on 108 SMs, the better being
    # 120/216 busy, against 288/324 for the QKV GEMM
    assert big > 0.6 and short_k < big / 1.6  # k = 192, near the A100's ~150 FLOP/byte ridge
    math_only = dataclasses.replace(A100, hbm=float("inf"))  # the roofline's compute side alone
    one_wave = float(gemm_efficiency(math_only, 128, 256 * 60, 12288))
    full = float(gemm_efficiency(math_only, 2048, 4608, 12288))
    assert one_wave == pytest.approx(full * (120 / 216) / (288 / 324), rel=1e-6)


def test_flash_attention_grows_with_sequence_and_head_dim():
    assert flash_efficiency(H200, 128, 8192) > flash_efficiency(H200, 128, 2048)
    assert flash_efficiency(H200, 128, 4096) > flash_efficiency(H200, 64, 4096)
    # measured d 128 at 8k (counted FLOPs / peak): 0.89
    att = next(a for a in measured()["attention"] if a["d"] == 128 and a["s"] == 8192)
    assert flash_efficiency(H200, 128, 8192) == pytest.approx(att["fwd_bwd_tflops"] / 989, rel=0.05)


def per_flop_time(hidden: int, stack: str = "megatron-lm") -> float:
    """Block seconds per model FLOP at tp 1: lower means a higher share of peak."""
    m = ModelConfig(layers=24, hidden=hidden, heads=hidden // 128, vocab=51200, seq_len=2048,
                    mlp="gelu")
    bt = block_times(m, A100, STACKS[stack], 1, 1, False, 0)
    from mscale.planner.flops import layer_forward_flops
    return float(bt.work) / (3 * layer_forward_flops(m))


def test_small_models_are_less_efficient_than_large_ones():
    """Memory-bound work per token grows as h, GEMM work as h²: the share of time below peak
    falls with width (issue 13: one constant over-predicted small models)."""
    t = [per_flop_time(h) for h in (2048, 4096, 12288)]
    assert t[0] > t[1] > t[2]
    assert t[0] / t[2] > 1.15


def test_stack_names_match_the_training_schema():
    assert set(typing.get_args(Stack)) == set(STACKS)
    assert all(p.doc for p in STACKS.values())


def test_stacks_price_their_overlaps():
    model = ModelConfig(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048, mlp="gelu")
    lo = LayoutConfig(tp=8, pp=8, dp=48, vpp=2, micro_batch=1, sequence_parallel=True,
                      zero_stage=1, recompute="selective")
    costs = {s: evaluate(Problem(model, TrainingConfig(global_batch=1536),
                                 ClusterConfig(nodes=384, gpu="A100"), stack=s), lo)
             for s in ("megascale", "megatron-core", "megatron-lm", "mscale")}
    assert costs["megascale"].t_tp < costs["megatron-core"].t_tp  # half of TP hidden
    assert costs["megatron-core"].t_dp < costs["megatron-lm"].t_dp  # DP overlapped or not
    assert costs["megatron-lm"].t_model > costs["megatron-core"].t_model  # no flash attention
    assert costs["megascale"].mfu > costs["megatron-core"].mfu > costs["megatron-lm"].mfu


def test_this_engine_is_priced_compiled_unless_the_training_file_turns_it_off():
    """The engine compiles its blocks on GPUs by default (fused norms); `compile: false`, or a
    CPU cluster where compilation is off by default, is priced as the eager engine. Another
    stack's profile does not follow the switch."""
    model = ModelConfig(layers=16, hidden=2048, heads=16, vocab=32000, seq_len=2048)
    lo = LayoutConfig(micro_batch=4)

    def cost(gpu="H200", stack=None, **training):
        pb = Problem(model, TrainingConfig(global_batch=16, **training),
                     ClusterConfig(nodes=1, gpus_per_node=1, gpu=gpu), stack=stack)
        return pb.stack_profile.name, evaluate(pb, lo)

    (name, compiled), (eager_name, eager) = cost(), cost(compile=False)
    assert (name, eager_name) == ("mscale", "mscale-eager")
    assert cost(compile=True)[0] == "mscale" and cost(gpu="cpu")[0] == "mscale-eager"
    assert cost(stack="mscale-eager")[1].step_time == eager.step_time
    assert eager.step_time > compiled.step_time  # only the norms' rate differs
    assert eager.mem_total == compiled.mem_total  # both priced as this engine allocates
    assert cost(stack="megascale", compile=False)[0] == "megascale"


def test_unknown_stack_is_refused_with_the_choices():
    from mscale.errors import MscaleError
    pb = Problem(ModelConfig(layers=2, hidden=64, heads=4, vocab=256, seq_len=64),
                 TrainingConfig(global_batch=8), ClusterConfig(nodes=1, gpu="A100"),
                 stack="deepspeed")
    with pytest.raises(MscaleError, match="unknown stack") as e:
        pb.stack_profile
    assert "megatron-lm" in e.value.fix


def test_search_offers_only_what_the_stack_has():
    """Megatron-LM's 2021-22 runs had no distributed optimizer and no hierarchical reduction:
    searching them with ZeRO-2 and hierarchical DP ranked layouts they could not run."""
    from mscale.planner.search import search
    model = ModelConfig(layers=32, hidden=4096, heads=32, vocab=51200, seq_len=2048, mlp="gelu")
    args = (model, TrainingConfig(global_batch=512), ClusterConfig(nodes=16, gpu="A100"))
    old = search(Problem(*args, stack="megatron-lm"))
    assert set(old.arrays["zero"][: old.count]) == {0} and not old.arrays["hier"][: old.count].any()
    ours = search(Problem(*args, stack="mscale"))
    assert set(ours.arrays["zero"][: ours.count]) == {0, 1, 2} and ours.arrays["hier"].any()
    pinned = search(Problem(model, TrainingConfig(global_batch=512, zero_stage=1), args[2],
                            stack="megatron-lm"))
    assert set(pinned.arrays["zero"][: pinned.count]) == {1}  # the training file wins
