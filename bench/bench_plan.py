"""Time the full layout search for GPT-175B on 12,288 A100s against a naive one-layout-at-a-time
search measured in the same run.

Reference: `evaluate()` called per layout (the scalar path a simple planner would loop over), timed
on a sample of the same candidates and scaled to their number. Usage:

    .venv/bin/python bench/bench_plan.py [--repeat 5] [--sample 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig, load_model
from mscale.planner.cost import Problem, evaluate
from mscale.planner.search import search

PLANS = Path(__file__).resolve().parents[1] / "plans"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sample", type=int, default=300)
    args = ap.parse_args()
    pb = Problem(load_model(ModelConfig, PLANS / "models" / "gpt-175b.yaml"),
                 load_model(TrainingConfig, PLANS / "training" / "gpt-175b.yaml"),
                 load_model(ClusterConfig, PLANS / "clusters" / "a100-12288.yaml"))
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        result = search(pb)
        times.append(time.perf_counter() - t0)
    full = statistics.median(times)
    step = max(1, result.count // args.sample)
    sample = [result.layout(i) for i in range(0, result.count, step)][: args.sample]
    t0 = time.perf_counter()
    for lo in sample:
        evaluate(pb, lo)
    per_layout = (time.perf_counter() - t0) / len(sample)
    naive = per_layout * result.examined
    print(f"search 175B / 12,288 GPUs: {result.examined} layouts costed, {result.count} fit")
    print(f"  vectorised search: median {full * 1000:.0f} ms over {args.repeat} runs "
          f"(min {min(times) * 1000:.0f} ms)")
    print(f"  reference, evaluate() per layout: {per_layout * 1e6:.0f} us × {result.examined} = "
          f"{naive:.2f} s")
    print(f"  ratio reference / search: {naive / full:.0f}x; budget 1 s: "
          f"{'met' if full < 1 else 'MISSED'}")


if __name__ == "__main__":
    main()
