"""Benchmark: mscale's 1F1B against torch.distributed.pipelining's Schedule1F1B, and the bubble.

For each pipeline size (default PP=2 and PP=4, one process per stage, gloo, fp32) both schedules
run the same stage modules (`parallelize.build_chunks`, same weights), micro-batches and data;
a step is forward + backward of every micro-batch (no optimizer), timed on rank 0 between two
barriers, alternating the two implementations so that load from other users hits both alike.
Prints per PP (not a test; no pass/fail):
- steps/s of mscale / steps/s of Schedule1F1B (goal >= 1.0), and the same ratio of CPU seconds
  per step summed over ranks (less sensitive to other users' load on a shared machine);
- mscale's measured bubble (time blocked on a receive during warm-up and cool-down, StepTimer
  ``bubble``) as a share of the step, averaged over ranks, against (p-1)/(m+p-1) for 1F1B and,
  with ``--vpp 2``, interleaved 1F1B against (p-1)/(v·m) of the ideal time.

    .venv/bin/python bench/bench_pipeline.py                  # PP=2 and PP=4, m=8
    .venv/bin/python bench/bench_pipeline.py --vpp 2          # interleaved bubble too
    .venv/bin/python bench/bench_pipeline.py --bare           # without mscale's DP grad buffer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class CachedLoader:
    """The step's micro-batches read once, so neither side pays for synthetic data generation."""

    def __init__(self, loader, m: int):
        self.batches = [loader.get(0, j) for j in range(m)]

    def get(self, step: int, micro: int):
        return self.batches[micro]


def build(args, rank: int, vpp: int):
    from tests.distributed.pipeline_plan import tiny_plan
    from mscale.topology.env import LaunchEnv
    from mscale.train.engine import build_engine
    from mscale.train.options import TrainOptions

    plan = tiny_plan(1, args.pp, 1, vpp=vpp, global_batch=args.m * args.mb, micro_batch=args.mb,
                     layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.heads,
                     ffn_hidden=4 * args.hidden, vocab=args.vocab, seq_len=args.seq)
    env = LaunchEnv(rank=rank, world_size=args.pp, local_rank=rank, local_world_size=args.pp,
                    node_rank=0, master_addr="127.0.0.1", master_port=0, launcher="torchrun",
                    hostname="local")
    engine = build_engine(plan, env, TrainOptions(run_dir=tempfile.mkdtemp(), timeout_s=300))
    engine.loader = CachedLoader(engine.loader, args.m)
    if args.bare:
        engine.grads = NoBuffer(engine)
    return plan, engine


class NoBuffer:
    """Stands in for the gradient buffer with ``--bare``: gradients accumulate in ``.grad`` as on
    the torch side, so the comparison is schedule against schedule."""

    def __init__(self, engine):
        engine.grads.close()  # removes the buffer's gradient hooks
        self.chunks = engine.chunks

    def no_sync(self):
        return contextlib.nullcontext()

    def finish(self) -> float:
        return 0.0

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad(set_to_none=True)


def mscale_step(engine):
    from mscale.parallel.pipeline import run_pipeline_step
    from mscale.train.timers import StepTimer

    timer = StepTimer()

    def step() -> dict:
        timer.start_step()
        run_pipeline_step(engine.pipeline, 0, timer)
        engine.grads.finish()
        out = timer.end_step()
        engine.grads.zero_grad()
        return out

    return step


def torch_step(args, plan, engine):
    """Schedule1F1B over fresh copies of the same chunk (same weights, no gradient hooks)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from mscale.parallel.parallelize import build_chunks

    g = engine.groups
    chunks, _ = build_chunks(plan, g.pp_rank, engine.chunks[0].tp, engine.device,
                             seed=plan.training.seed)
    module = chunks[0]
    stage = PipelineStage(module, g.pp_rank, args.pp, engine.device, group=g.pp_group)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    sched = Schedule1F1B(stage, n_microbatches=args.m, loss_fn=loss_fn)
    tokens = torch.cat([t for t, _ in engine.loader.batches])
    labels = torch.cat([y for _, y in engine.loader.batches])

    def step() -> dict:
        if g.is_first_stage:
            sched.step(tokens)
        elif g.is_last_stage:
            sched.step(target=labels, losses=[])
        else:
            sched.step()
        module.zero_grad(set_to_none=True)
        return {}

    return step


def timed(step) -> tuple[float, float, dict]:
    """(wall seconds between barriers, this rank's CPU seconds in the step, mscale's timings)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    timings = step()
    cpu = time.process_time() - c0
    dist.barrier()
    return time.perf_counter() - t0, cpu, timings


def worker(rank: int, world: int, args) -> dict:
    torch.set_num_threads(args.threads)
    plan, engine = build(args, rank, 1)
    impls = {"mscale": mscale_step(engine), "torch": torch_step(args, plan, engine)}
    times = {k: [] for k in impls}
    cpu = {k: [] for k in impls}
    bubbles = []
    for rep in range(args.warmup + args.steps):
        order = list(impls) if rep % 2 == 0 else list(impls)[::-1]
        for name in order:
            seconds, cpu_s, timings = timed(impls[name])
            if rep >= args.warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_s)
                if timings:
                    bubbles.append(timings["bubble"] / timings["step"])
    out = {"times": times, "cpu": cpu, "bubble": statistics.median(bubbles)}
    if args.vpp > 1:
        out["bubble_vpp"] = interleaved_bubble(args, rank)
    return out


def interleaved_bubble(args, rank: int) -> float:
    _, engine = build(args, rank, args.vpp)
    step, shares = mscale_step(engine), []
    for rep in range(args.warmup + args.steps):
        _, _, t = timed(step)
        if rep >= args.warmup:
            shares.append(t["bubble"] / t["step"])
    return statistics.median(shares)


def _cpu(results: list[dict], impl: str) -> float:
    """Median CPU seconds per step summed over ranks: the work done, whatever the load."""
    return sum(statistics.median(r["cpu"][impl]) for r in results)


def report(results: list[dict], args) -> dict:
    ms = statistics.median(results[0]["times"]["mscale"])
    tt = statistics.median(results[0]["times"]["torch"])
    p, m, v = args.pp, args.m, args.vpp
    row = {"pp": p, "micro_batches": m, "mscale_step_s": round(ms, 4), "torch_1f1b_step_s": round(tt, 4),
           "throughput_ratio": round(tt / ms, 3), "cpu_ratio": round(_cpu(results, "torch")
                                                                     / _cpu(results, "mscale"), 3),
           "bubble_measured": round(statistics.mean(r["bubble"] for r in results), 3),
           "bubble_formula": round((p - 1) / (m + p - 1), 3)}
    if v > 1:
        ideal = (p - 1) / (v * m)
        row.update(vpp=v, bubble_vpp_measured=round(statistics.mean(r["bubble_vpp"] for r in results), 3),
                   bubble_vpp_formula=round(ideal / (1 + ideal), 3))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--vpp", type=int, default=1, help="also measure interleaved 1F1B's bubble")
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--mb", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bare", action="store_true",
                   help="mscale without its DP gradient buffer (whose per-parameter copy hook "
                        "the torch side does not pay)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args()
    from mscale.distributed.spawn import run_distributed

    rows = []
    for pp in args.pp:
        sub = argparse.Namespace(**{**vars(args), "pp": pp})
        rows.append(report(run_distributed(worker, pp, sub, timeout_s=600), sub))
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
