"""bench_data.py's section 2, loader: `DatasetTokens.batch` on two sources blended 3:1 against
``np.memmap`` slicing, at the micro-batch shapes of the demo's and the 1B run's plans; also the
shapes and the data config that section 3 (bench_data_remote.py) reads. torch and pydantic are
imported where they are used (bench_data.py's module comment says why).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from bench_data_prepare import VOCAB

REPO = Path(__file__).resolve().parents[1]
SEED = 1234


def shapes(args) -> dict[str, dict]:
    """seq_len and micro_batch of the demo's plan and of the 1B plan (defaults if missing)."""
    import yaml

    out = {}
    for name, plan, default in (("demo", "plans/cpu-text.yaml", (128, 2, 16)),
                                ("1B", "plans/gpu-1b-h200.yaml", (2048, 8, 16))):
        path = REPO / plan
        seq, mb, gb = default
        if path.is_file():
            p = yaml.safe_load(path.read_text())
            seq = p["model"]["seq_len"]
            mb = (p.get("layout") or {}).get("micro_batch") or p["training"]["micro_batch"]
            gb = p["training"]["global_batch"]
        else:
            plan = f"{plan} (missing: defaults)"
        if name == "demo":
            seq, mb = args.demo_seq or seq, args.demo_micro or mb
        step_s = args.demo_step_s if name == "demo" else args.gpu_step_s
        out[name] = {"plan": plan, "seq_len": seq, "micro_batch": mb, "global_batch": gb,
                     "step_s": step_s, "needed_tok_s": round(gb * seq / step_s)}
    return out


def data_config(paths: list[str]):
    from mscale.config.training import DataConfig

    return DataConfig(sources=[{"path": paths[0], "weight": 3}, {"path": paths[1], "weight": 1}],
                      eval_fraction=0.01)


def bench_loader(args, tmp: str, shape: dict) -> dict:
    import torch

    from mscale.train.data import make_sources

    seq, mb = shape["seq_len"], shape["micro_batch"]
    source, _ = make_sources(data_config([f"{tmp}/tokens-w1", f"{tmp}/tokens-w2"]), SEED, seq,
                             VOCAB)
    n = max(20, args.loader_tokens // (mb * seq))  # micro-batches per round
    flat = np.memmap(f"{tmp}/tokens-w1/shard-00000.bin", dtype="<u2", mode="r")
    count = (flat.size - 1) // seq
    rng = np.random.default_rng(SEED)
    ours, floor, index = [], [], []
    for r in range(args.rounds + 1):  # round 0 warms the page cache and the code paths
        starts = rng.integers(0, count, size=(n, mb)) * seq
        t0 = time.perf_counter()
        for i in range(n):
            rows = [flat[s:s + seq + 1] for s in starts[i]]
            torch.from_numpy(np.stack(rows).astype(np.int64))
        t1 = time.perf_counter()
        base = r * n * mb
        for i in range(n):
            source.batch(list(range(base + i * mb, base + (i + 1) * mb)))
        t2 = time.perf_counter()
        for i in range(n):  # the index maths alone: blend, shuffle, split (no token read)
            source.samples.mixture.locate(np.arange(base + i * mb, base + (i + 1) * mb))
        t3 = time.perf_counter()
        if r:
            floor.append(t1 - t0)
            ours.append(t2 - t1)
            index.append(t3 - t2)
    tokens = n * mb * seq
    o, f, x = statistics.median(ours), statistics.median(floor), statistics.median(index)
    return {"micro_batches": n, "tok_s": round(tokens / o), "floor_tok_s": round(tokens / f),
            "ratio_to_floor": round(f / o, 3), "us_per_micro_batch": round(o / n * 1e6, 1),
            "floor_us_per_micro_batch": round(f / n * 1e6, 1),
            "index_share": round(x / o, 3), "index_us_per_micro_batch": round(x / n * 1e6, 1),
            "headroom_vs_step": round(tokens / o / shape["needed_tok_s"], 1)}
