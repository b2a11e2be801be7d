"""Benchmark: what the flight recorder costs a training process (distributed/flight.py).

`train` turns torch's flight recorder on for every job (2,000 entries), and a rank that fails
dumps it. Measured here, on 2 gloo processes over loopback, in the same script:
- a collective's time with the recorder on / off: many small all-reduces back to back (16 floats:
  the control flags and timing vectors the loop exchanges every step), where a per-collective
  cost shows most; goal <= 1.05;
- one dump (`flight.write_dump`) with the ring full: its time and its size on disk.

    .venv/bin/python bench/bench_flight.py [--ops 3000] [--rounds 5]

Prints one JSON line. Rounds alternate off and on, each in fresh processes (torch reads the
recorder's size once, when a process makes its first group); the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed_ops(rank: int, world: int, ops: int, out: str) -> dict:
    import torch
    import torch.distributed as dist

    from mscale.distributed import flight

    t = torch.ones(16)
    for _ in range(50):  # warm the connections
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t)
    per_op = (time.perf_counter() - t0) / ops
    dump_s = None
    if out and rank == 0:
        t0 = time.perf_counter()
        flight.write_dump(out, rank)
        dump_s = time.perf_counter() - t0
    return {"per_op_s": per_op, "dump_s": dump_s}


def one_round(ops: int, entries: int, out: str = "") -> dict:
    from mscale.distributed import flight
    from mscale.distributed.spawn import run_distributed

    os.environ.pop(flight.LEGACY_BUFFER_ENV, None)
    os.environ[flight.BUFFER_ENV] = str(entries)
    return run_distributed(timed_ops, 2, ops, out, timeout_s=120)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from mscale.distributed import flight

    off, on = [], []
    for _ in range(args.rounds):
        off.append(one_round(args.ops, 0)["per_op_s"])
        on.append(one_round(args.ops, flight.DEFAULT_ENTRIES)["per_op_s"])
    with tempfile.TemporaryDirectory() as out:
        dumped = one_round(max(args.ops, flight.DEFAULT_ENTRIES), flight.DEFAULT_ENTRIES, out)
        size = sum(p.stat().st_size for p in Path(out).iterdir())
    print(json.dumps({
        "ops": args.ops, "rounds": args.rounds,
        "per_op_us_off": round(statistics.median(off) * 1e6, 1),
        "per_op_us_on": round(statistics.median(on) * 1e6, 1),
        "on_over_off": round(statistics.median(on) / statistics.median(off), 3),
        "dump_ms": round(dumped["dump_s"] * 1e3, 1), "dump_bytes": size}))


if __name__ == "__main__":
    main()
