"""The training loop's per-step host collectives on gloo, by world size: how they grow.

    .venv/bin/python bench/bench_poll.py [--ranks 2 4 8 16 32] [--repeats 200]

Why it exists: every step runs two collectives over the whole job on host tensors, so on gloo
even on GPUs (docs/architecture.md): the control poll, an all-reduce (MAX) of a few flags
(`train/control.py`), and the metrics gather of each rank's timings to rank 0
(`train/metrics.py`). gloo's all-reduce is a ring: 2(n - 1) steps one after another, each a
network round trip, so its time grows with the job; at 12,288 ranks even 20 µs a step would be
~0.5 s a training step. This script measures how the time grows with n on one machine (a
localhost round trip stands in for the network's; n processes on few cores add scheduling), and
beside the all-reduce, as the reference, the same reduction as a ``reduce`` to rank 0 followed
by a ``broadcast`` from it, to see whether gloo's reduce and broadcast grow more slowly.

Per world size each rank runs every collective ``--repeats`` times after ten untimed (no
barrier between calls: a step's poll follows the previous one's); rank 0's median per call is
printed in µs with the slope of a least-squares line through the world sizes (µs per rank).
A measurement, not a test: it asserts nothing.
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

FLAGS = 5
"""Elements of the control poll's tensor (train/control.py)."""
FIELDS = 10
"""Elements of a rank's metrics row (train/metrics.py FIELDS)."""


def _median_us(call, repeats: int) -> float:
    times = []
    for i in range(repeats + 10):
        t0 = time.perf_counter()
        call()
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _measure(rank: int, world: int, repeats: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    flags = torch.zeros(FLAGS, dtype=torch.float64)
    row = torch.zeros(FIELDS, dtype=torch.float64)
    rows = [torch.empty(FIELDS, dtype=torch.float64) for _ in range(world)] if rank == 0 else None

    def reduce_broadcast() -> None:
        dist.reduce(flags, dst=0, op=dist.ReduceOp.MAX)
        dist.broadcast(flags, src=0)
    return {
        "all_reduce": _median_us(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX), repeats),
        "reduce+broadcast": _median_us(reduce_broadcast, repeats),
        "gather": _median_us(lambda: dist.gather(row, rows, dst=0), repeats),
    }


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    rows = {}
    for n in args.ranks:
        rows[n] = run_distributed(_measure, n, args.repeats, timeout_s=120)[0]
    names = list(next(iter(rows.values())))
    print(f"median µs per call, rank 0 ({args.repeats} calls; torch {torch.__version__})")
    print("ranks  " + "".join(f"{name:>18}" for name in names))
    for n, r in rows.items():
        print(f"{n:>5}  " + "".join(f"{r[name]:>18.0f}" for name in names))
    if len(rows) > 1:
        xs = list(rows)
        print("slope  " + "".join(f"{_slope(xs, [rows[n][k] for n in xs]):>15.1f}/rk"
                                  for k in names))


if __name__ == "__main__":
    main()
