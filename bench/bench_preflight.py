"""Benchmark: preflight's bus bandwidth against a plain torch.distributed loop, and its wall time.

Not a test; prints figures (no pass/fail).

1. all-reduce bus bandwidth of one group as preflight measures it (`preflight.network`:
   train's collective wrappers, a barrier before each timed iteration, best of the level's
   iterations) / a plain ``dist.all_reduce`` loop of the same tensor size on the same group
   (best iteration, the same nccl-tests busbw formula)                         goal within 5 %
2. wall time of ``mscale preflight plans/cpu-tiny.yaml --local 8 --level quick`` (8 gloo
   processes: start-up, every check, the report)

    .venv/bin/python bench/bench_preflight.py              # world 4, 1 MiB and 16 MiB, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _both(rank: int, world: int, nbytes: int, iters: int) -> dict:
    """On every rank: preflight's figure, then the plain loop's, on one world-sized group."""
    import torch
    import torch.distributed as dist

    from mscale.preflight import network
    from mscale.preflight.compute import Slowdown

    group = dist.new_group(list(range(world)))
    network.ITERS["bench"] = iters
    numel = (nbytes // 4) // world * world
    t = torch.ones(numel)
    dist.all_reduce(t, group=group)
    ours = plain = 0.0
    for _ in range(3):  # alternate, so neither side is always the first, colder one
        mine = network._time_group("dp", list(range(world)), group, nbytes,
                                   torch.device("cpu"), "bench", Slowdown())
        ours = max(ours, next(x for x in mine if x["op"] == "allreduce")["busbw"])
        best = float("inf")
        for _ in range(iters):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            best = min(best, time.perf_counter() - t0)
        plain = max(plain, numel * 4 / best / 1e9 * network.bus_factor("allreduce", world))
    return {"preflight": ours, "plain": plain}


def busbw(world: int, sizes: list[int], repeats: int, iters: int) -> None:
    from mscale.distributed.spawn import run_distributed

    for nbytes in sizes:
        ratios = []
        for _ in range(repeats):
            res = run_distributed(_both, world, nbytes, iters, timeout_s=120)
            ours = min(r["preflight"] for r in res)  # a group's figure: its slowest member's
            plain = min(r["plain"] for r in res)
            ratios.append(ours / plain)
            print(f"  {nbytes >> 20} MiB world {world}: preflight {ours:.3f} GB/s, plain "
                  f"{plain:.3f} GB/s, ratio {ours / plain:.3f}", flush=True)
        print(f"all-reduce busbw {nbytes >> 20} MiB: median ratio preflight/plain "
              f"{statistics.median(ratios):.3f} (goal 0.95-1.05)", flush=True)


def wall_time(repeats: int) -> None:
    exe = str(Path(sys.executable).parent / "mscale")
    times = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            p = subprocess.run([exe, "preflight", str(REPO / "plans" / "cpu-tiny.yaml"),
                                "--run-dir", f"{d}/run", "--local", "8", "--json"],
                               capture_output=True, text=True, cwd=REPO)
            times.append(time.perf_counter() - t0)
            status = json.loads(p.stdout)["status"] if p.stdout.strip() else p.stderr[-200:]
        print(f"  --level quick at world 8: {times[-1]:.1f} s (exit {p.returncode}, {status})",
              flush=True)
    print(f"--level quick wall time at world 8: median {statistics.median(times):.1f} s",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    busbw(a.world, [s << 20 for s in a.sizes_mib], a.repeats, a.iters)
    wall_time(a.repeats)


if __name__ == "__main__":
    main()
