"""Benchmark: initialising one rank of GPT-3 175B at tp8·pp8 on the CPU, shard tiles against
full tensors.

One rank (pipeline stage 0, TP rank 0: the embedding's shard and 12 blocks' shards, ~2.8 B
values) is built on the meta device and materialised on the CPU, then initialised either as the
engine does (`init_parameters`: only the tiles of each global tensor that the rank's shard
overlaps are drawn, `model/params.py`) or as it did before, the reference: every parameter's
full global tensor drawn from one generator and this rank's slice copied out. Each variant runs
in a fresh process, which reports the init's wall time and its peak resident memory over what
the materialised parameters already held (`ru_maxrss`). The values differ between the two
(different draws, the same distribution); each is the same at every layout. Not a test.

    .venv/bin/python bench/bench_init.py                  # the 175B rank (needs ~14 GB, minutes)
    .venv/bin/python bench/bench_init.py --layers 2       # the same rank's first 2 blocks only
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "plans" / "gpt-175b-h800-12288.yaml"


def rank_chunks(layers: int | None):
    """Stage 0, TP rank 0 of the 175B model at tp8·pp8 (vpp 1), parameters on the CPU,
    uninitialised."""
    from mscale.config.plan import load_plan
    from mscale.parallel.parallelize import build_chunks
    from mscale.parallel.tensor import TensorParallel

    plan = load_plan(str(PLAN), check=False)
    layout = plan.layout.model_copy(update=dict(tp=8, pp=8, vpp=1, dp=192, stage_layers=None))
    model = plan.model
    if layers is not None:  # a cut-down stage: the same matrices, fewer of them
        model = model.model_copy(update=dict(layers=8 * layers))
    plan = plan.model_copy(update=dict(layout=layout, model=model))
    tp = TensorParallel(group=None, size=8, rank=0, sequence_parallel=True)
    chunks, table = build_chunks(plan, 0, tp, torch.device("cpu"))
    return [p for c in chunks for p in c.parameters()], table, plan.model.layers


def reference_init(params, table, seed: int, num_layers: int) -> None:
    """Before: each parameter's full global tensor drawn, this rank's slice copied."""
    from mscale.model.params import init_std, name_seed
    with torch.no_grad():
        for p, spec in zip(params, table, strict=True):
            if not spec.weight_decay:
                p.fill_(1.0)
                continue
            generator = torch.Generator().manual_seed(name_seed(seed, spec.name))
            full = torch.empty(spec.global_shape).normal_(
                0.0, init_std(spec.name, num_layers), generator=generator)
            p.copy_(full[table.local_slice(spec)])
            del full


def child(variant: str, layers: int | None) -> dict:
    from mscale.parallel.parallelize import init_parameters
    params, table, num_layers = rank_chunks(layers)
    with torch.no_grad():
        for p in params:  # touch every page: the baseline holds the parameters themselves
            p.zero_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if variant == "tiles":
        init_parameters(params, table, seed=1234, num_layers=num_layers)
    else:
        reference_init(params, table, seed=1234, num_layers=num_layers)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    owned = sum(p.numel() for p in params)
    drawn = sum(torch.Size(s.global_shape).numel() for s in table if s.weight_decay)
    return dict(variant=variant, seconds=seconds, params_bytes=owned * 4,
                init_extra_bytes=peak - before, owned_values=owned, full_values=drawn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="blocks in the measured stage (default: the plan's 12)")
    ap.add_argument("--child", choices=("tiles", "full"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return
    extra = [] if args.layers is None else ["--layers", str(args.layers)]
    out = {}
    for variant in ("full", "tiles"):
        p = subprocess.run([sys.executable, __file__, "--child", variant, *extra],
                           capture_output=True, text=True, cwd=REPO, check=True)
        out[variant] = json.loads(p.stdout.strip().splitlines()[-1])
        r = out[variant]
        print(f"{variant:>5}: {r['seconds']:7.2f} s, peak host memory over the parameters "
              f"{r['init_extra_bytes'] / 1e6:8.1f} MB (parameters {r['params_bytes'] / 1e9:.2f} GB)")
    full, tiles = out["full"], out["tiles"]
    print(f"tiles / full: time {tiles['seconds'] / full['seconds']:.3f}; values this rank owns "
          f"{full['owned_values'] / 1e9:.2f} B of the {full['full_values'] / 1e9:.2f} B its "
          f"tensors hold in full")


if __name__ == "__main__":
    main()
