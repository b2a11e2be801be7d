"""Effective training time of a multi-week run at the paper's scale, by simulation.

    .venv/bin/python bench/bench_recover_sim.py [--seeds 20] [--detect-s S --restart-s S]

Prints markdown tables (docs/recover-simulation.md keeps the figures):
1. MegaScale's setting (12,288 GPUs, 175B, Llama 3's failure rate, detection and diagnosis within
   10 minutes, >90% of faults repaired automatically) against its reported >90% ETT;
2. the recovery times that reach 95% at each share of automatic repairs;
3. mscale's own phase times (``--detect-s``, ``--diagnose-s``, ``--restart-s``: measured by
   bench/bench_recover.py) at the same scale.
Each row: the simulation's mean (min–max over seeds) beside Young/Daly's first-order figure.
The run takes a minute or two; while it does, a line on stderr says where it is every
``--progress-every`` seconds (default 4; stdout keeps only the tables).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Callable

from mscale.recover.simulate import SimInputs, estimate, for_model
from mscale.watch.detect.evaluate import Progress  # the same stderr ticker

PARAMS_175B = 175e9
TARGET = 0.95


def row(name: str, inp: SimInputs, seeds: int) -> str:
    e = estimate(inp, seeds)
    return (f"| {name} | {inp.detect_s + inp.diagnose_s:.0f} | {inp.restart_s:.0f} | "
            f"{inp.auto_fraction:.2f} | {e.interval_s:.0f} | {e.failures_mean:.0f} | "
            f"{e.ett_mean:.1%} ({e.ett_min:.1%}–{e.ett_max:.1%}) | {e.analytic:.1%} |")


def longest_recovery_for(target: float, base: SimInputs, seeds: int,
                         tick: Callable[[str], None] = lambda where: None) -> float:
    """Largest detect+diagnose+restart (s, split 1:3 as in a crash found quickly) whose mean ETT
    still reaches ``target``; 0 when even an instant recovery does not."""
    def ok(total: float) -> bool:
        tick(f"{base.auto_fraction:.0%} automatic: trying a {total:.0f} s recovery")
        inp = replace(base, detect_s=total / 4, diagnose_s=0.0, restart_s=3 * total / 4)
        return estimate(inp, seeds).ett_mean >= target
    if not ok(1.0):
        return 0.0
    lo, hi = 1.0, 7200.0
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--days", type=float, default=21.0)
    ap.add_argument("--detect-s", type=float, default=None, help="mscale's measured detection")
    ap.add_argument("--diagnose-s", type=float, default=5.0)
    ap.add_argument("--restart-s", type=float, default=None, help="mscale's measured restart")
    ap.add_argument("--progress-every", type=float, default=4.0, metavar="S",
                    help="seconds between progress lines on stderr (0: none)")
    args = ap.parse_args()
    with Progress(args.progress_every, name="bench_recover_sim") as tick:
        report(args, tick)


def report(args, tick: Callable[[str], None]) -> None:

    base = for_model(PARAMS_175B, SimInputs(days=args.days, restart_s=0.0))
    load = base.restart_s  # reading the checkpoint back at the published read bandwidth
    print(f"175B on {base.gpus:,} GPUs ({base.nodes:,} nodes), {args.days:g} days, "
          f"{base.failures_per_1000_node_days} failures/1000 node-days → job MTBF "
          f"{base.mtbf_s / 3600:.2f} h; snapshot {base.snapshot_s * 1e3:.0f} ms/GPU, upload "
          f"{base.upload_s:.0f} s, checkpoint load {load:.1f} s\n")
    print("| scenario | detect+diagnose s | restart s | auto | interval s | failures | ETT "
          "simulated | ETT Young/Daly |")
    print("|---|---|---|---|---|---|---|---|")
    mega = replace(base, detect_s=540.0, diagnose_s=60.0, restart_s=300.0 + load,
                   auto_fraction=0.9, manual_s=3600.0)
    rows = [("MegaScale-like: found+diagnosed ≤10 min, 5 min restart, 90% automatic", mega),
            ("same, a hang left to the 30-min default timeout", replace(mega, detect_s=1800.0))]
    fast = replace(mega, detect_s=30.0, diagnose_s=10.0, restart_s=120.0 + load)
    rows += [(f"30 s detect, 2 min restart, {auto:.0%} automatic",
              replace(fast, auto_fraction=auto)) for auto in (0.9, 0.97, 1.0)]
    if args.detect_s is not None and args.restart_s is not None:
        rows.append(("mscale's measured phases (all automatic)",
                     replace(base, detect_s=args.detect_s, diagnose_s=args.diagnose_s,
                             restart_s=args.restart_s + load, auto_fraction=1.0)))
    for i, (name, inp) in enumerate(rows):
        tick(f"scenario {i + 1}/{len(rows)}, {args.seeds} seeds")
        print(row(name, inp, args.seeds), flush=True)

    print(f"\nLongest detect+diagnose+restart that still reaches {TARGET:.0%} (Young/Daly "
          "interval; a failure needing a human costs 1 h more):\n")
    print("| automatic share | longest recovery s |")
    print("|---|---|")
    for auto in (0.9, 0.95, 0.97, 0.99, 1.0):
        worst = longest_recovery_for(TARGET, replace(base, auto_fraction=auto, manual_s=3600.0),
                                     max(5, args.seeds // 2), tick)
        print(f"| {auto:.0%} | {worst:.0f} |" if worst else f"| {auto:.0%} | unreachable |",
              flush=True)


if __name__ == "__main__":
    main()
