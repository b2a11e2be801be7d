"""Benchmark: the mscale engine on one process against a plain PyTorch loop of the same model.

Prints the tokens/s ratio engine / plain (goal >= 0.97): what the engine's machinery costs when
there is nothing to parallelise (gradient buckets and hooks, the flat fp32 optimizer, timers, the
metrics record and control polling of every step). Both sides run the same model (the plain
`Transformer`: as is in the textbook loop, parallelized at tp=1 by the engine), the same
initial weights, data, micro-batches, AdamW settings and gradient clipping; rounds alternate
(ABAB...) so drift on shared cores hits both alike; medians of per-step times are compared.

    .venv/bin/python bench/bench_engine.py [--steps 8 --rounds 3 --hidden 256 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_plan(args):
    from tests.distributed.engine_cases import make_plan as case_plan

    model = dict(layers=args.layers, hidden=args.hidden, heads=args.hidden // 32,
                 kv_heads=args.hidden // 32, ffn_hidden=args.hidden * 3, vocab=args.vocab,
                 seq_len=args.seq)
    training = dict(global_batch=args.batch, steps=10_000, lr=1e-4, warmup_steps=0,
                    bucket_mb=25.0, adaptive_clip=False, grad_clip=1.0, weight_decay=0.1)
    return case_plan(dict(mb=args.micro, model=model, training=training))


def engine_steps(args, plan, run_dir: str) -> list[float]:
    """Per-step seconds of the full engine loop (train.loop._run's per-step work)."""
    from mscale.config.records import MetricsRecord  # noqa: F401 - warm import
    from mscale.runs.rundir import RunDir
    from mscale.topology.env import LaunchEnv
    from mscale.train.control import Control
    from mscale.train.engine import build_engine
    from mscale.train.loop import train_step
    from mscale.train.metrics import build_record, gather_rank_vectors
    from mscale.train.options import TrainOptions
    from mscale.train.timers import StepTimer

    env = LaunchEnv(0, 1, 0, 1, 0, "127.0.0.1", 0, "bench", "localhost")
    engine = build_engine(plan, env, TrainOptions(run_dir=run_dir))
    run, control, timer = RunDir(run_dir), Control(RunDir(run_dir).control, 0), StepTimer()
    run.create()
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        timer.start_step()
        res = train_step(engine, step, timer)
        vec = gather_rank_vectors(timer.end_step(), res.loss, 1)
        rec = build_record(vec, step=step + 1, grad_norm=res.grad_norm, clip_threshold=res.threshold,
                           lr=res.lr, tokens=1, flops_per_step=None, peak_flops_per_device=1.0)
        run.append_record(run.metrics, rec)
        control.poll()
        times.append(time.perf_counter() - t0)
    engine.grads.close()
    return times[1:]  # the first step allocates buffers


def plain_steps(args, plan) -> list[float]:
    """Per-step seconds of the textbook loop: the plain Transformer, torch.optim.AdamW,
    clip_grad_norm_."""
    from mscale.model import Transformer, init_weights
    from mscale.train.data import BatchPlan, DataLoader, make_source

    t = plan.training
    model = Transformer(plan.model)
    init_weights(model, t.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    loader = DataLoader(make_source(t.data, t.seed, plan.model.seq_len, plan.model.vocab),
                        BatchPlan(t.global_batch, plan.layout.micro_batch, 1, 0))
    m = plan.layout.micro_batches(t.global_batch)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        for j in range(m):
            x, y = loader.get(step, j)
            loss = model(x, y)
            (loss / m).backward()
            float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    args = ap.parse_args()
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    plan = make_plan(args)
    eng, ref = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            ref += plain_steps(args, plan)
            eng += engine_steps(args, plan, os.path.join(tmp, f"run{r}"))
    tokens = args.batch * args.seq
    me, mr = statistics.median(eng), statistics.median(ref)
    print(f"model: {plan.model.num_parameters() / 1e6:.1f}M params, batch {args.batch}x{args.seq}, "
          f"{plan.layout.micro_batches(args.batch)} micro-batches, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"plain PyTorch: {mr * 1e3:.1f} ms/step  {tokens / mr:,.0f} tok/s")
    print(f"mscale engine: {me * 1e3:.1f} ms/step  {tokens / me:,.0f} tok/s")
    print(f"ratio engine/plain tokens/s: {mr / me:.3f}  (goal >= 0.97)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
