"""The planner's memory against the engine's own objects: its schedule, its autograd graph, its
buffers. (The whole-rank peak of the running engine: tests/distributed/test_memory_peak.py.)"""

import numpy as np
import pytest
import torch

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig
from mscale.config.layout import even_split
from mscale.model.transformer import Block
from mscale.parallel.parallelize import TensorParallelBlock
from mscale.parallel.pipeline.schedule import schedule
from mscale.parallel.tensor import TensorParallel
from mscale.planner.cost import Problem, evaluate, layout_arrays
from mscale.planner.memory import (activation_bytes_per_layer, block_saved_bytes,
                                   megatron_block_bytes,
                                   in_flight_chunks, in_flight_micro_batches, state_bytes,
                                   rank_memory, state_bytes_per_param,
                                   weight_copy_bytes)

S, B, H, A = 2048, 1, 12288, 96  # GPT-3: 5·a·s/h = 80
SBH = S * B * H
SMALL = dict(name="m", layers=2, hidden=256, heads=8, kv_heads=4, ffn_hidden=512, vocab=1024,
             seq_len=128)


def engine_in_flight(p, v, m, rank):
    """Most chunk forwards awaiting their backward in the engine's schedule of ``rank``."""
    live = most = 0
    for action in schedule(p, v, m, rank):
        live += 1 if action.forward else -1
        most = max(most, live)
    return most


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 1, 4), (8, 1, 32), (4, 2, 8), (4, 2, 4),
                                   (8, 6, 16), (3, 32, 3), (3, 32, 6), (8, 2, 32), (2, 3, 4)])
def test_in_flight_chunks_match_the_engine_schedule(p, v, m):
    for rank in range(p):
        assert int(in_flight_chunks(p, v, m, rank)) == engine_in_flight(p, v, m, rank)


def test_in_flight_micro_batches_of_the_first_rank():
    assert float(in_flight_micro_batches(8, 1, 32)) == 8      # 1F1B: p in flight
    assert float(in_flight_micro_batches(1, 1, 32)) == 1      # no pipeline
    assert float(in_flight_micro_batches(8, 6, 32)) == pytest.approx(8 * (1 + 7 / 48))
    assert float(in_flight_micro_batches(3, 32, 3)) == 3.0    # capped by the step's m·v chunks
    # the last rank of an interleaved pipeline holds p − (p−1)/v, not 1 + (p−1)/v: 6.83, not 2.17
    assert float(in_flight_chunks(8, 6, 32, 7)) / 6 == pytest.approx(8 - 7 / 6)


def saved_by_autograd(cfg: ModelConfig, b: int, rec: int, precision: str) -> int:
    """Bytes of the distinct storages one block's forward leaves for its backward, parameters
    and their bf16 autocast copies excluded (the planner counts those apart)."""
    torch.manual_seed(0)
    block = TensorParallelBlock(Block(cfg), TensorParallel.single(),
                                "selective" if rec == 1 else "none")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def is_weight_copy(t) -> bool:  # (a view of) autocast's cast of a parameter
        fn = t.grad_fn
        while type(fn).__name__ in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
            fn = fn.next_functions[0][0]
        nxt = fn.next_functions[0][0] if fn is not None and fn.next_functions else None
        return type(fn).__name__ == "ToCopyBackward0" and isinstance(
            getattr(nxt, "variable", None), torch.nn.Parameter)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.dtype.is_floating_point and not is_weight_copy(t):
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(cfg.seq_len, b, cfg.hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            block(x)
    return sum(seen.values())


@pytest.mark.parametrize("variant", [{}, {"kv_heads": 2}, {"parallel_block": True},
                                     {"mlp": "gelu", "ffn_hidden": 1024}, {"sliding_window": 16}])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("rec", [0, 1])
def test_block_saved_bytes_match_the_autograd_graph(variant, precision, rec):
    """GQA, SwiGLU/GeLU, parallel blocks and sliding windows priced from their own shapes: the
    planner's bytes per block within 3% of what autograd keeps (measured: 0.4-1.9% under)."""
    cfg = ModelConfig(**{**SMALL, **variant})
    got = saved_by_autograd(cfg, 2, rec, precision)
    planned = float(block_saved_bytes(cfg, 2, 1, False, rec, precision, cuda=False))
    assert planned == pytest.approx(got, rel=0.03)


def test_full_recompute_keeps_the_block_input_only():
    cfg = ModelConfig(**SMALL)
    n_h = cfg.seq_len * 2 * cfg.hidden
    assert float(block_saved_bytes(cfg, 2, 4, False, 2, "bf16")) == 4 * n_h
    assert float(block_saved_bytes(cfg, 2, 4, True, 2, "bf16")) == 4 * n_h / 4


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_engine_state_keeps_the_full_fp32_gradient_buffer_under_every_zero_stage(zero):
    st = {k: float(v) for k, v in state_bytes("bf16", 8, zero).items()}
    assert st["params"] == 4 and st["grad_buffer"] == 4  # fp32 parameters; buckets alive at peak
    if zero == 0:
        assert st["grad_shard"] == st["master"] == 0 and st["moments"] == 8  # master = params
    else:
        assert st["grad_shard"] == st["master"] == 0.5 and st["moments"] == 1


def test_175b_best_layout_of_issue_13_carries_its_full_gradients():
    """Issue 13: tp4 pp3 v32 ZeRO-2 on 12,288 A100s was priced at 71.5 GB with 0.06 GB of
    gradients; the engine keeps each bucket's fp32 gradient from the first backward to the
    reduction: 4 bytes per parameter of the rank, ~59 GB more."""
    model = ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=96, vocab=50257,
                        seq_len=2048, mlp="gelu")
    pb = Problem(model, TrainingConfig(global_batch=6144), ClusterConfig(nodes=1536, gpu="A100"))
    lo = LayoutConfig(tp=4, pp=3, dp=1024, vpp=32, micro_batch=1, sequence_parallel=True,
                      zero_stage=2, recompute="full")
    c = evaluate(pb, lo)
    rank_params = c.mem_weights / 4
    assert c.mem_gradients >= 4 * rank_params > 55e9
    assert not c.fits


@pytest.mark.parametrize("stack", [None, "megascale"])
def test_a_middle_rank_holding_the_most_blocks_is_priced(stack):
    """530B on 64 H100s, tp1 pp64 with empty end stages: the planner priced only the first and
    last pipeline ranks (the embedding alone, the head alone) and said 43 GB fits, while the
    middle ranks hold two 5B-parameter blocks each (~160 GB of training state)."""
    model = ModelConfig(name="gpt-530b", layers=105, hidden=20480, heads=128, vocab=64000,
                        seq_len=2048, mlp="gelu")
    split = [0] + even_split(105, 62) + [0]
    lo = LayoutConfig(tp=1, pp=64, dp=1, micro_batch=1, zero_stage=0, recompute="full",
                      stage_layers=split)
    pb = Problem(model, TrainingConfig(global_batch=64),
                 ClusterConfig(nodes=8, gpus_per_node=8, gpu="H100"),
                 **({"stack": stack} if stack else {}))
    c = evaluate(pb, lo)
    block = 12 * 20480 ** 2  # a GPT block's matrices
    assert c.mem_weights >= 2 * block * 2  # two blocks' weights, bf16 at the least
    assert c.mem_total > 2 * block * 14 and not c.fits  # and their gradients and Adam state


# Megatron-LM's accounting, kept for other stacks' published runs (megatron_memory)
@pytest.mark.parametrize("t,sp,rec,coeff", [
    (1, False, 0, 34 + 80), (8, False, 0, 10 + 24 / 8 + 80 / 8), (8, True, 0, (34 + 80) / 8),
    (8, True, 1, 34 / 8), (8, False, 1, 10 + 24 / 8), (8, False, 2, 2), (8, True, 2, 2 / 8),
    (1, True, 0, 34 + 80)])
def test_korthikanti_activation_bytes(t, sp, rec, coeff):
    assert float(activation_bytes_per_layer(S, B, H, A, t, sp, rec)) == pytest.approx(SBH * coeff)


@pytest.mark.parametrize("t,sp,rec", [(1, False, 0), (8, False, 0), (8, True, 0), (8, True, 1),
                                       (8, False, 1), (8, False, 2), (8, True, 2)])
def test_model_aware_count_is_korthikanti_for_a_gpt_block(t, sp, rec):
    gpt = ModelConfig(name="gpt3", layers=96, hidden=H, heads=A, seq_len=S, mlp="gelu",
                      ffn_hidden=4 * H, vocab=51200)
    got = float(megatron_block_bytes(gpt, B, t, sp, rec, flash=False))
    assert got == pytest.approx(float(activation_bytes_per_layer(S, B, H, A, t, sp, rec)))


def test_model_aware_count_knows_flash_gqa_and_swiglu():
    """Llama 3 405B's block at tp 8 with SP: a flash kernel keeps no scores (none = selective);
    8 K/V heads of 128 keep 1/16 of Q's width; SwiGLU keeps three 53,248-wide tensors."""
    llama = ModelConfig(name="405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                        ffn_hidden=53248, vocab=128256, seq_len=8192)
    sbh = 8192 * 16384
    none = float(megatron_block_bytes(llama, 1, 8, True, 0, flash=True))
    assert none == float(megatron_block_bytes(llama, 1, 8, True, 1, flash=True))
    assert none == pytest.approx(sbh * (10 + 4 + 4 / 16 + 6 * 53248 / 16384) / 8)
    scores = float(megatron_block_bytes(llama, 1, 8, True, 0, flash=False)) - none
    assert scores == pytest.approx(5 * 128 * 8192 * 8192 / 8)


@pytest.mark.parametrize("zero,expected", [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 8),
                                           (2, 2 + 4 / 8 + 12 / 8)])
def test_megatron_state_bytes_under_zero(zero, expected):
    per = state_bytes_per_param("bf16", 8, zero)
    assert sum(float(v) for v in per.values()) == pytest.approx(expected)


def test_other_stacks_use_megatron_accounting():
    model = ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=96, vocab=50257,
                        seq_len=2048, mlp="gelu")
    lo = LayoutConfig(tp=8, pp=8, dp=192, vpp=6, micro_batch=1, sequence_parallel=True,
                      zero_stage=2, recompute="none")
    args = (model, TrainingConfig(global_batch=6144), ClusterConfig(nodes=1536, gpu="A100"))
    theirs = evaluate(Problem(*args, stack="megascale"), lo)
    ours = evaluate(Problem(*args), lo)
    assert theirs.fits and ours.fits and ours.mem_total > theirs.mem_total
    assert np.isclose(theirs.mem_weights * 2, ours.mem_weights, rtol=0.05)  # bf16 vs fp32


def test_megascale_175b_layout_fits_with_one_bf16_copy_per_step():
    """Issue 13: MegaScale's 175B layout (tp 8, pp 8, v 6) holds 9.2 micro-batches in flight on
    the first rank. With a bf16 weight copy per micro-batch in flight (one autocast context per
    forward) its 12 blocks cost 46.4 GiB of copies and the rank 102 GiB; the engine now shares
    one copy per step (Precision.cast_scope): 5.06 GiB, 60.9 GiB in all, within the A100's 67 GiB."""
    model = ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=96, vocab=50257,
                        seq_len=2048, mlp="gelu")
    lo = LayoutConfig(tp=8, pp=8, dp=192, vpp=6, micro_batch=1, sequence_parallel=True,
                      zero_stage=2, recompute="none")
    pb = Problem(model, TrainingConfig(global_batch=6144), ClusterConfig(nodes=1536, gpu="A100"))
    mem = rank_memory(pb, layout_arrays([lo], model.layers), lo.micro_batches(6144))
    one_copy = 2 * 12 * 12 * 12288 ** 2 / 8  # 12 blocks of 12·h² matrix weights, /tp, bf16
    assert float(mem["mem_weight_copies"][0]) == pytest.approx(one_copy, rel=0.01)
    assert float(mem["mem_total"][0]) < 62 * 2**30 and evaluate(pb, lo).fits


@pytest.mark.parametrize("rec,blocks", [(0, 1.0), (1, 1.0), (2, 0.0)])
def test_weight_copies_do_not_grow_with_micro_batches_in_flight(rec, blocks):
    """One bf16 copy of each matrix weight of the rank for the step, whatever the schedule holds
    in flight; none for the blocks under full recompute (the engine keeps autocast per forward
    there); the head's copy on the rank that has it."""
    cfg = ModelConfig(**SMALL)
    per_block = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)  # Q, O; K, V (GQA); MLP
    got = float(weight_copy_bytes(cfg, 3, 1, rec, False, True))
    assert got == blocks * 3 * per_block
    head = float(weight_copy_bytes(cfg, 3, 2, rec, True, True)) - blocks * 3 * per_block / 2
    assert head == 2 * 1024 * 256 / 2
    assert float(weight_copy_bytes(cfg, 3, 1, rec, True, False)) == 0.0  # fp32: no copies


@pytest.mark.parametrize("split, vpp", [
    ("light", 1), ("light", 2), ("even", 1), ("even", 3), ("exact", 2)])
def test_the_fullest_pipeline_rank_is_priced_exactly_for_the_searchs_splits(split, vpp):
    """Every rank priced with its own blocks and micro-batches in flight: the worst of them is
    what rank_memory says (it prices ranks 0, 1, the last and the first holding the most)."""
    from mscale.planner.cost import layout_arrays
    from mscale.planner.memory import _rank_peak, rank_memory
    from mscale.planner.search import light_split

    model = ModelConfig(name="m", layers=94 if split == "even" else 96, hidden=4096, heads=32,
                        vocab=32000, seq_len=2048)
    pp = 16 if vpp == 1 else 8
    stages = {"light": light_split(model.layers, pp, vpp),
              "even": even_split(model.layers, pp * vpp),
              "exact": even_split(model.layers, pp * vpp)}[split]
    lo = LayoutConfig(tp=4, pp=pp, dp=2, vpp=vpp, micro_batch=1, zero_stage=1,
                      recompute="none", stage_layers=stages)
    pb = Problem(model, TrainingConfig(global_batch=64), ClusterConfig(nodes=16, gpu="H100"))
    c = layout_arrays([lo], model.layers)
    micro = np.array([64 // 2])
    per_rank = [sum(stages[r::pp]) for r in range(pp)]
    brute = max(float(_rank_peak(pb, c, micro, r, per_rank[r], r == 0, r == pp - 1)
                      ["mem_total"][0]) for r in range(pp))
    assert float(rank_memory(pb, c, micro)["mem_total"][0]) == pytest.approx(brute, rel=1e-12)
