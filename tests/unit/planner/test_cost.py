"""The combined cost model: bubble, accounting identities, and the published-MFU calibration."""

import pytest

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig
from mscale.planner.cost import Problem, evaluate

GPT175 = ModelConfig(name="gpt-175b", layers=96, hidden=12288, heads=128, vocab=64000,
                     seq_len=2048, mlp="gelu")


def megascale(gpus: int, **kw) -> tuple[Problem, LayoutConfig]:
    pb = Problem(GPT175, TrainingConfig(global_batch=6144), ClusterConfig(nodes=gpus // 8, gpu="A100"),
                 stack="megascale")
    args = dict(tp=8, pp=8, dp=gpus // 64, vpp=6, micro_batch=1, sequence_parallel=True,
                zero_stage=2, recompute="none")
    args.update(kw)
    return pb, LayoutConfig(**args)


# MegaScale (arXiv 2402.15627) §6.1 Table 2, 175B, batch 6144, TP 8 PP 8 v 6 (Table 1)
PUBLISHED_MFU = {3072: 0.591, 6144: 0.573, 8192: 0.549, 12288: 0.552}
TOLERANCE = 0.015  # stated in constants.GEMM_MAX_EFFICIENCY and docs/plan.md


@pytest.mark.parametrize("gpus", sorted(PUBLISHED_MFU))
def test_mfu_reproduces_megascale_table2(gpus):
    """Regression guard of the fit: GEMM_MAX_EFFICIENCY["ampere"] was fitted on these four rows
    (the only published rows fitted on; residuals −0.6/−0.2/+1.2/−0.9 points). Memory is not
    checked: under this engine's accounting (planner/memory.py) MegaScale's ZeRO-2 layout does
    not fit 80 GB without recompute; MegaScale's engine frees gradients that this one keeps."""
    cost = evaluate(*megascale(gpus))
    assert cost.mfu == pytest.approx(PUBLISHED_MFU[gpus], abs=TOLERANCE)


@pytest.mark.parametrize("p,v", [(8, 1), (8, 6), (4, 2)])
def test_bubble_fraction(p, v):
    pb, lo = megascale(3072, pp=p, vpp=v, dp=3072 // (8 * p))
    c = evaluate(pb, lo)
    compute = c.t_model + c.t_recompute + c.t_imbalance
    assert c.t_bubble / compute == pytest.approx((p - 1) / (v * c.micro_batches))


def test_step_is_the_sum_of_its_terms_and_losses_add_up():
    c = evaluate(*megascale(12288, recompute="full"))
    terms = c.t_model + c.t_recompute + c.t_imbalance + c.t_bubble + c.t_tp + c.t_pp + c.t_dp
    assert c.step_time == pytest.approx(terms)
    assert c.mfu + sum(c.losses().values()) == pytest.approx(1.0)
    assert c.hfu > c.mfu and c.t_recompute > 0


def test_mfu_uses_dense_peak():
    hopper = Problem(GPT175, TrainingConfig(global_batch=6144), ClusterConfig(nodes=1536, gpu="H800"))
    c = evaluate(hopper, megascale(12288)[1])
    assert c.mfu == pytest.approx(hopper.model_flops / (c.step_time * 12288 * 989e12))


def test_zero_shrinks_memory_and_recompute_shrinks_activations():
    mems = [evaluate(*megascale(3072, zero_stage=z)).mem_total for z in (0, 1, 2)]
    # ZeRO-1 shards the optimizer; ZeRO-2's gradient shards do not lower this engine's peak
    # (the full buckets live through every backward: planner/memory.py)
    assert mems[0] > mems[1] >= mems[2]
    acts = [evaluate(*megascale(3072, recompute=r)).mem_activations
            for r in ("none", "selective", "full")]
    # MegaScale runs flash attention: no s×s scores to keep, so selective saves nothing
    assert acts[0] == acts[1] > acts[2]
    pb, lo = megascale(3072)
    pb = Problem(pb.model, pb.training, pb.cluster, stack="megatron-lm")  # no flash kernel
    acts = [evaluate(pb, lo.model_copy(update={"recompute": r, "zero_stage": 0})).mem_activations
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_interleaving_trades_bubble_for_exposed_transfers():
    """Deeper interleaving halves the bubble each time v doubles but lengthens the chain of
    transfers the fill and drain cannot hide: 2·(p·v − 1) of them (comm.pp_critical_transfers)."""
    costs = {v: evaluate(*megascale(12288, vpp=v)) for v in (2, 6, 12)}
    assert costs[2].t_bubble > costs[6].t_bubble > costs[12].t_bubble
    assert costs[2].t_pp < costs[6].t_pp < costs[12].t_pp
    assert costs[6].t_bubble / costs[12].t_bubble == pytest.approx(2.0)
