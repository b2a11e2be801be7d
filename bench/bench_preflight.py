"""Benchmark: preflight's bus bandwidth against a plain torch.distributed loop, and its wall time.

Not a test; prints figures (no pass/fail).

1. all-reduce bus bandwidth of one group as preflight measures it (`preflight.busbw`:
   train's collective wrappers, a barrier before each timed iteration, best of the level's
   iterations) / a plain ``dist.all_reduce`` loop of the same tensor size on the same group
   (best iteration, the same nccl-tests busbw formula)                         goal within 5 %
2. wall time of ``mscale preflight plans/cpu-tiny.yaml --local 8 --level quick`` (8 gloo
   processes: start-up, every check, the report)
3. ``--false-positives N``: N healthy runs of that preflight (any flagged result counts against
   it: goal 0) and N runs with rank 5 slowed 4x (its node, node3, must be the only one excluded
   every time: goal N); suspects measured again and cleared are counted too

    .venv/bin/python bench/bench_preflight.py              # world 4, 1 MiB and 16 MiB, 3 repeats
    .venv/bin/python bench/bench_preflight.py --false-positives 20
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

    from mscale.preflight import busbw, pace
    from mscale.preflight.compute import Slowdown

    group = dist.new_group(list(range(world)))
    pace.ITERS["bench"] = iters
    numel = (nbytes // 4) // world * world
    t = torch.ones(numel)
    dist.all_reduce(t, group=group)
    ours = plain = 0.0
    for _ in range(3):  # alternate, so neither side is always the first, colder one
        mine = busbw.time_group("dp", list(range(world)), group, nbytes,
                                torch.device("cpu"), "bench", Slowdown())
        ours = max(ours, next(x for x in mine if x["op"] == "allreduce")["busbw"])
        best = float("inf")
        for _ in range(iters):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            best = min(best, time.perf_counter() - t0)
        plain = max(plain, numel * 4 / best / 1e9 * busbw.bus_factor("allreduce", world))
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


def _preflight(run_dir: str, *extra: str) -> tuple[int, dict]:
    exe = str(Path(sys.executable).parent / "mscale")
    p = subprocess.run([exe, "preflight", str(REPO / "plans" / "cpu-tiny.yaml"), "--run-dir",
                        run_dir, "--local", "8", "--json", *extra], capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    if not p.stdout.strip():
        raise SystemExit(f"preflight printed no report (exit {p.returncode}): {p.stderr[-500:]}")
    return p.returncode, json.loads(p.stdout)


def false_positives(n: int) -> None:
    """Healthy runs that flag anything, and slowed runs that miss node3 or blame another."""
    flagged_runs = cleared = 0
    walls = []
    for i in range(n):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            code, rep = _preflight(f"{d}/run")
            walls.append(time.perf_counter() - t0)
        bad = [f"{r['check']} {r['entity']} {r['status']}" for r in rep["results"]
               if r["status"] != "OK"]
        flagged_runs += bool(bad) or code != 0
        cleared += rep.get("judging", {}).get("cleared", 0)
        print(f"  healthy {i + 1}/{n}: exit {code}, flagged {bad or 'nothing'}, suspects cleared "
              f"{rep.get('judging', {}).get('cleared', 0)}, {walls[-1]:.1f} s", flush=True)
    named = 0
    for i in range(n):
        with tempfile.TemporaryDirectory() as d:
            code, rep = _preflight(f"{d}/run", "--inject-slow", "5:4")
        ok = code == 2 and rep["bad_nodes"] == ["node3"]
        named += ok
        print(f"  slowed {i + 1}/{n}: exit {code}, bad nodes {rep['bad_nodes']}", flush=True)
    print(f"healthy runs flagged: {flagged_runs}/{n} (goal 0), suspects cleared by the second "
          f"round: {cleared}, wall time median {statistics.median(walls):.1f} s (max "
          f"{max(walls):.1f}); slowed runs naming node3 alone: {named}/{n} (goal {n})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--false-positives", type=int, metavar="N",
                    help="only run N healthy and N slowed preflights and count their verdicts")
    a = ap.parse_args()
    if a.false_positives:
        false_positives(a.false_positives)
        return
    busbw(a.world, [s << 20 for s in a.sizes_mib], a.repeats, a.iters)
    wall_time(a.repeats)


if __name__ == "__main__":
    main()
