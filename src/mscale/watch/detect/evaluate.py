"""How well the rules do on simulated traces whose truth is known (docs/benchmarks.md).

For each cause: inject it into a simulated job at a random step and target, run a `Watcher`
over the trace, and score the first finding after the onset: detected at all, latency in steps,
right cause, right rank/node/stage, anything else it raised, and its what-if slowdown against
the true one (the same seed without the injection). Healthy traces count false alarms.

    python -m mscale.watch.detect.evaluate                 # the docs/benchmarks.md tables
    python -m mscale.watch.detect.evaluate --quick         # fewer trials
    taskset -c 0 python -m mscale.watch.detect.evaluate --scale   # judge cost at 12,288 ranks
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.findings import Finding
from mscale.watch.judge import Watcher
from mscale.watch.sim import Injection, generate
from mscale.watch.window import Window

STRAGGLERS = ("slow_device", "slow_node", "slow_link", "slow_data", "stage_imbalance",
              "data_imbalance", "job_wide")
TRAINING = ("grad_spike", "nan", "divergence")


@dataclass(frozen=True)
class Job:
    """A simulated layout."""

    world: int
    tp: int
    pp: int
    ranks_per_node: int = 8

    def __str__(self) -> str:
        return f"{self.world} ranks (tp {self.tp}, pp {self.pp}, dp " \
               f"{self.world // (self.tp * self.pp)}, {self.ranks_per_node}/node)"


@dataclass
class Outcome:
    cause: str
    detected: bool
    latency: int | None
    right_cause: bool
    right_target: bool
    others: list[str]
    """kind/cause of any other finding after the onset."""
    early: int
    """Findings before the onset (false alarms)."""
    slowdown_pct: float | None
    true_pct: float | None
    rollback_error: int | None = None
    """Divergence: the named first bad step minus the true onset."""


def _target(cause: str, job: Job, rng) -> int | None:
    layout = generate(job.world, job.tp, job.pp, None, job.ranks_per_node, 1).layout
    if cause in ("slow_device", "slow_link"):
        return int(rng.integers(job.world))
    if cause == "slow_data":
        return int(rng.choice(np.flatnonzero(layout.tp_rank == 0)))
    if cause == "slow_node":
        return int(rng.integers(len(layout.node_names)))
    if cause == "stage_imbalance":
        return int(rng.integers(job.pp))
    return None


def _hits(f: Finding, cause: str, target, trace) -> bool:
    """Whether ``f`` names the injected place."""
    layout = trace.layout
    if cause in ("slow_device", "slow_link", "slow_data"):
        return f.ranks == [target]
    if cause == "slow_node":
        return f.nodes == [layout.node_names[target]]
    if cause == "stage_imbalance":
        return f.evidence.get("stage") == target and not f.nodes
    return not f.nodes or cause == "job_wide"


def run_case(cause: str, job: Job, seed: int, steps: int = 400, onset: int | None = None,
             config: WatchConfig | None = None) -> Outcome:
    """Inject ``cause`` once and score what the watcher says."""
    rng = np.random.default_rng(seed + 7919)
    onset = int(rng.integers(steps // 4, steps // 2)) if onset is None else onset
    target = _target(cause, job, rng)
    args = (job.world, job.tp, job.pp, None, job.ranks_per_node, steps, seed)
    trace = generate(*args, inject=[Injection(cause, onset, target)])
    found = Watcher(trace.layout, config).feed(trace.window())
    start = max(onset, (config or WatchConfig()).warmup_steps + 1)
    early = [f for f in found if f.evidence["detected_at"] < onset]
    late = [f for f in found if f.evidence["detected_at"] >= onset]
    kind = "straggler" if cause in STRAGGLERS else cause
    first = next((f for f in late if f.kind == kind), None)
    match = next((f for f in late if f.kind == kind and (kind != "straggler"
                                                           or f.cause == cause)), None)
    true_pct = None
    if cause in STRAGGLERS:
        healthy = generate(*args)
        after = slice(start + 20, None)
        true_pct = 100.0 * (float(np.median(trace.step_time[after].max(axis=1)))
                            / float(np.median(healthy.step_time[after].max(axis=1))) - 1)
    return Outcome(
        cause=cause, detected=match is not None,
        latency=None if match is None else match.evidence["detected_at"] - start,
        right_cause=first is not None and first is match,
        right_target=match is not None and _hits(match, cause, target, trace),
        others=[f"{f.kind}/{f.cause}" for f in late if f is not match],
        early=len(early), slowdown_pct=None if match is None else match.slowdown_pct,
        true_pct=true_pct, rollback_error=match.first_step - onset
        if match is not None and cause == "divergence" else None)


def healthy_alarms(job: Job, steps: int, seed: int, flag_pauses: bool = True) -> list[Finding]:
    """Every finding on a healthy trace (each one a false alarm)."""
    trace = generate(job.world, job.tp, job.pp, None, job.ranks_per_node, steps, seed,
                     flag_pauses=flag_pauses)
    return Watcher(trace.layout).feed(trace.window())


def _table(job: Job, trials: int, steps: int) -> list[str]:
    lines = [f"Injected causes, {job}, {trials} trials each, {steps} steps:", "",
             "| cause | detected | latency (steps, median/max) | right cause | right place | "
             "other findings | what-if / true slowdown (medians) |",
             "|---|---|---|---|---|---|---|"]
    for cause in STRAGGLERS + TRAINING:
        outs = [run_case(cause, job, seed, steps) for seed in range(trials)]
        lat = [o.latency for o in outs if o.latency is not None]
        wi = [(o.slowdown_pct, o.true_pct) for o in outs
              if o.slowdown_pct is not None and o.true_pct]
        ratio = f"{np.median([a for a, _ in wi]):.0f}% / {np.median([b for _, b in wi]):.0f}%" \
            if wi else "-"
        back = [o.rollback_error for o in outs if o.rollback_error is not None]
        if back:
            ratio = f"first bad step {min(back):+d}..{max(back):+d} from the onset"
        lines.append(
            f"| {cause} | {sum(o.detected for o in outs)}/{trials} | "
            + (f"{int(np.median(lat))}/{max(lat)}" if lat else "-")
            + f" | {sum(o.right_cause for o in outs)}/{trials} | "
              f"{sum(o.right_target for o in outs)}/{trials} | "
              f"{sum(len(o.others) + o.early for o in outs)} | {ratio} |")
    return lines


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def scale(records: int = 1000, chunk: int = 50) -> None:
    """Judge time per record and memory at 12,288 ranks (tp 8, pp 16, dp 96), fed 10 rows a
    look as a live watch would; the trace is generated ``chunk`` steps at a time."""
    job = Job(12288, 8, 16)
    watcher, spent, rss = None, 0.0, []
    for c in range(records // chunk):
        t = generate(job.world, job.tp, job.pp, None, 8, chunk, seed=c,
                     warmup=(3.0, 1.5, 1.2) if c == 0 else ())
        win = t.window()
        win.steps += c * chunk
        watcher = watcher or Watcher(t.layout)
        for i in range(0, chunk, 10):
            part = Window(win.steps[i:i + 10], win.ranks[i:i + 10], win.scalars[i:i + 10],
                          win.extra[i:i + 10])
            t0 = time.perf_counter()
            assert watcher.feed(part) == []
            spent += time.perf_counter() - t0
        del t, win, part  # the trace is the harness's, not the judge's: measure without it
        rss.append(_rss_mb())
    print(f"judge at {job}: {1e3 * spent / records:.1f} ms per record "
          f"({records / spent:.0f} records/s on one core); resident memory after "
          f"{2 * chunk} records {rss[1]:.0f} MB, after {records} {rss[-1]:.0f} MB")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer trials and steps")
    ap.add_argument("--scale", action="store_true", help="only the cost at 12,288 ranks")
    args = ap.parse_args(argv)
    if args.scale:
        return scale()
    trials = 3 if args.quick else 20
    t0 = time.perf_counter()
    for job in (Job(64, 2, 4), Job(1024, 8, 8)):
        print("\n".join(_table(job, trials if job.world < 1000 else max(2, trials // 4), 400)))
        print()
    print("False alarms on healthy traces:\n")
    print("| job | steps | traces | pauses flagged | findings |\n|---|---|---|---|---|")
    for job, steps, n in ((Job(64, 2, 4), 5000, 1 if args.quick else 4),
                          (Job(1024, 8, 8), 2000, 1 if args.quick else 3)):
        for flagged in (True, False):
            alarms = [len(healthy_alarms(job, steps, seed, flagged)) for seed in range(n)]
            print(f"| {job} | {steps} | {n} | {'yes' if flagged else 'no'} | {sum(alarms)} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
