"""gloo's reduce-scatter, all-reduce and all-gather of one tensor, side by side.

    .venv/bin/python bench/bench_collectives.py [--mb 32] [--ranks 2 4] [--repeats 5]

Why it exists: `distributed/collectives.reduce_scatter_into` runs an all-reduce and keeps the
own chunk on gloo, instead of gloo's reduce-scatter, because the reduce-scatter was measured
slower than the full all-reduce of the same tensor (docs/benchmarks.md, "gloo's reduce-scatter is
slower than its all-reduce"). This script is that measurement, to rerun when torch or gloo
changes: if the reduce-scatter column ever drops below the all-reduce column, the workaround
should go.

Per world size, every rank runs each collective on the same fp32 tensor (``--mb`` megabytes in
all: the reduce-scatter's input and the all-gather's output are that size), a barrier before
each call, ``--repeats`` timed calls after two untimed (each reduction works on a fresh copy of
the tensor, the copy timed with it: the same for the three reductions); rank 0's median is printed in ms, with
``reduce_scatter_into`` (the engine's path) as a fourth column. A measurement, not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mscale.distributed.spawn import run_distributed  # noqa: E402


def _median_ms(call, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        call()
        if i >= 2:  # the first two connect and allocate
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _measure(rank: int, world: int, mb: float, repeats: int) -> dict:
    import torch.distributed as dist

    from mscale.distributed.collectives import reduce_scatter_into

    torch.set_num_threads(1)  # one thread a rank, as --local gives each worker
    # the names torch 2.13 prefers; older torch has only the *_tensor ones
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    numel = int(mb * 2**20 / 4) // world * world
    full = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    chunk = torch.empty(numel // world)
    return {
        "all-reduce": _median_ms(lambda: dist.all_reduce(full.clone()), repeats),
        "reduce-scatter": _median_ms(
            lambda: reduce_scatter(chunk, full.clone()), repeats),
        "all-gather": _median_ms(lambda: all_gather(full, chunk), repeats),
        "reduce_scatter_into": _median_ms(
            lambda: reduce_scatter_into(chunk, full.clone(), None, scratch=True), repeats),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=32.0, help="tensor size in MB (fp32)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per collective")
    args = ap.parse_args()
    cols = ["all-reduce", "reduce-scatter", "all-gather", "reduce_scatter_into"]
    print(f"gloo, loopback, {args.mb:g} MB fp32, median of {args.repeats} (ms), torch "
          f"{torch.__version__}")
    print("| ranks | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for world in args.ranks:
        row = run_distributed(_measure, world, args.mb, args.repeats, timeout_s=120.0)[0]
        print(f"| {world} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
