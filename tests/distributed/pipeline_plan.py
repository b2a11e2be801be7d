"""Tiny plans for the pipeline tests, and the single-process run they must agree with.

The reference goes through the engine's own non-pipelined path (`train.step.forward_backward`
with pp = 1): same model code, same data, same optimizer, one process.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch

from mscale.config.plan import Plan

MODEL = dict(name="tiny-pp", layers=6, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64,
             seq_len=16)


def tiny_plan(tp: int = 1, pp: int = 1, dp: int = 1, *, vpp: int = 1, sp: bool = False,
              zero: int = 1, global_batch: int = 8, micro_batch: int = 2, lr: float = 1e-3,
              stage_layers: list[int] | None = None, **model) -> Plan:
    """A plan for tp·pp·dp ranks on one node, fp32, AdamW at constant ``lr``."""
    world = tp * pp * dp
    return Plan.model_validate(dict(
        name="pp-test",
        cluster=dict(name="local", nodes=1, gpus_per_node=world, gpu="cpu"),
        model={**MODEL, **model},
        training=dict(global_batch=global_batch, micro_batch=micro_batch, precision="fp32",
                      optimizer="adamw", zero_stage=zero, recompute="none", steps=10, lr=lr,
                      warmup_steps=0, lr_schedule="constant", seed=1234, bucket_mb=0.004,
                      grad_clip=1.0, adaptive_clip=False),
        layout=dict(tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=sp,
                    micro_batch=micro_batch, zero_stage=zero, stage_layers=stage_layers)))


def clip_coef(plan: Plan, norm: float) -> float:
    return min(1.0, plan.training.grad_clip / (norm + 1e-6))


def reference_run(plan: Plan, steps: int) -> dict:
    """The same training on one process without pipelining: losses, norms, final parameters."""
    from mscale.parallel.data import data_parallel
    from mscale.parallel.parallelize import build_chunks, full_state_dict
    from mscale.parallel.tensor import TensorParallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.train.data import BatchPlan, DataLoader, make_source
    from mscale.train.step import forward_backward
    from mscale.train.timers import StepTimer

    single = tiny_plan(global_batch=plan.training.global_batch, lr=plan.training.lr,
                       micro_batch=plan.layout.micro_batch, **plan.model.model_dump())
    tp, training = TensorParallel.single(), single.training
    (model,), table = build_chunks(single, 0, tp, torch.device("cpu"), seed=training.seed)
    params = list(model.parameters())
    grads, pbuf = data_parallel(params, table, None, zero_stage=0, bucket_bytes=int(training.bucket_mb * 1e6))
    opt = DistributedOptimizer(params, table, grads, pbuf, training, None)
    source = make_source(training.data, training.seed, single.model.seq_len, single.model.vocab)
    loader = DataLoader(source, BatchPlan(training.global_batch, single.layout.micro_batch, 1, 0))
    engine = SimpleNamespace(
        plan=single, chunks=[model], micro_batches=single.layout.micro_batches(training.global_batch),
        loader=loader, get_batch=loader.get,
        grads=grads, device=torch.device("cpu"), env=SimpleNamespace(rank=0),
        precision=SimpleNamespace(autocast=lambda: torch.autocast("cpu", enabled=False),
                                  cast_scope=contextlib.nullcontext), pipeline=None)
    losses, norms = [], []
    for step in range(steps):
        losses.append(forward_backward(engine, step, StepTimer()))
        grads.finish()
        norms.append(opt.grad_norm())
        opt.step(training.lr, clip_coef(single, norms[-1]))
    assert all(math.isfinite(x) for x in losses)
    return {"losses": losses, "norms": norms, "params": full_state_dict([model], table, tp)}
