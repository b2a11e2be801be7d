"""What share of a multi-week run trains, given failures, checkpoints and the time to recover.

A discrete-event simulation of one long job (docs/recover-simulation.md). Failures arrive as a
Poisson process at the job's rate (nodes × per-node rate). Between failures the job trains and,
every ``interval_s`` of training, blocks for ``snapshot_s`` (the checkpoint's copy to host memory);
the copy is durable ``upload_s`` later (the background write), so a failure during the upload
falls back to the checkpoint before. A failure loses the training since the last durable
checkpoint and costs detection, diagnosis and restart (relaunch, start-up, loading); a share of
failures is not repaired automatically and waits for a human (``manual_s``). A failure during a
recovery starts the recovery again. Effective training time (ETT) = training kept / wall time,
MegaScale's measure (arXiv 2402.15627 §6).

The analytic check is Young/Daly's first-order waste, 1 − C/τ − (τ/2 + R)/MTBF
(`mscale.planner.goodput.effective_fraction`), with R the mean recovery time: the simulation
agrees with it when τ and R are small against the MTBF, and shows where it does not.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from mscale.errors import MscaleError
from mscale.planner.constants import (CHECKPOINT_BYTES_PER_PARAM, FAILURES_PER_1000_NODE_DAYS,
                                      SNAPSHOT_GB_PER_S, STORAGE_READ_GB_PER_S,
                                      STORAGE_WRITE_GB_PER_S)
from mscale.planner.goodput import effective_fraction, job_mtbf_s, young_daly


@dataclass(frozen=True)
class SimInputs:
    """One scenario. Times in seconds. Defaults: the paper's scale (12,288 GPUs) at Llama 3's
    published failure rate (docs/references.md), three weeks."""

    gpus: int = 12288
    """GPUs in the job."""
    gpus_per_node: int = 8
    """GPUs per node: failures are counted per node."""
    days: float = 21.0
    """Wall time simulated."""
    failures_per_1000_node_days: float = FAILURES_PER_1000_NODE_DAYS
    """Interruptions per 1,000 node-days (3.79: Llama 3's 419 unexpected interruptions in 54 days
    on 16,384 GPUs)."""
    interval_s: float | None = None
    """Training time between checkpoints; None: Young/Daly's optimum for this scenario."""
    snapshot_s: float = 5.0
    """Training blocked per checkpoint (GPU → host copy of each rank's shard)."""
    upload_s: float = 120.0
    """Time after the snapshot until the checkpoint is durable (background write)."""
    detect_s: float = 60.0
    """Failure → noticed (a crash is seen at once; a hang only after the collective timeout)."""
    diagnose_s: float = 30.0
    """Reading the evidence, choosing the checkpoint and the nodes to keep out."""
    restart_s: float = 300.0
    """Relaunch → training again: scheduling, process start, group set-up, checkpoint load."""
    auto_fraction: float = 0.9
    """Share of failures repaired without a human (MegaScale reports more than 90%)."""
    manual_s: float = 3600.0
    """Extra time a failure that needs a human costs."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is None:
                continue
            bad = not math.isfinite(value) or value < 0
            if name in ("gpus", "gpus_per_node", "days", "failures_per_1000_node_days"):
                bad = bad or value <= 0
            if name == "auto_fraction":
                bad = bad or value > 1
            if name == "interval_s":
                bad = bad or value <= 0
            if bad:
                raise MscaleError(f"{value!r} is out of range", field=name,
                                  fix="give a finite number (positive; auto_fraction in [0, 1])")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def mtbf_s(self) -> float:
        return job_mtbf_s(self.nodes, self.failures_per_1000_node_days)

    @property
    def mean_recovery_s(self) -> float:
        """Detection + diagnosis + restart, plus the expected wait for a human."""
        return (self.detect_s + self.diagnose_s + self.restart_s
                + (1 - self.auto_fraction) * self.manual_s)

    def chosen_interval_s(self) -> float:
        """The interval in force: given, or Young/Daly sqrt(2·C·MTBF) with C the snapshot, never
        shorter than one upload (the next snapshot waits for the previous write)."""
        if self.interval_s is not None:
            return self.interval_s
        return max(young_daly(max(self.snapshot_s, 1e-3), self.mtbf_s), self.upload_s)


def for_model(params: float, base: SimInputs = SimInputs()) -> SimInputs:
    """``base`` with the checkpoint times of a model of ``params`` parameters from the planner's
    published bandwidths (planner/constants.py): each GPU copies its shard to host memory, the
    filesystem writes the whole checkpoint, and a restart also reads it back."""
    total = params * CHECKPOINT_BYTES_PER_PARAM
    return replace(base, snapshot_s=total / base.gpus / (SNAPSHOT_GB_PER_S * 1e9),
                   upload_s=total / (STORAGE_WRITE_GB_PER_S * 1e9),
                   restart_s=base.restart_s + total / (STORAGE_READ_GB_PER_S * 1e9))


@dataclass
class SimResult:
    """What one simulated run did."""

    wall_s: float
    trained_s: float
    """Training kept at the end (lost work and blocked time excluded)."""
    failures: int
    lost_work_s: float
    recovery_s: float
    checkpoint_s: float
    """Time blocked by snapshots."""

    @property
    def ett(self) -> float:
        return self.trained_s / self.wall_s


def simulate(inp: SimInputs, seed: int = 0) -> SimResult:
    """One run of ``inp.days`` on one random failure sequence."""
    rng = random.Random(seed)
    wall, tau, mtbf = inp.days * 86400.0, inp.chosen_interval_s(), inp.mtbf_s
    t, durable, progress = 0.0, 0.0, 0.0
    pending: list[tuple[float, float]] = []  # (durable at wall time, progress it holds)
    failures, lost, recovering, blocked = 0, 0.0, 0.0, 0.0
    next_fail = rng.expovariate(1 / mtbf)
    since = 0.0  # training since the last snapshot
    while t < wall:
        # Train until the next snapshot is due, the failure, or the end.
        run = min(tau - since, next_fail - t, wall - t)
        t, progress, since = t + run, progress + run, since + run
        durable = _settle(pending, t, durable)
        if t >= wall:
            break
        if t >= next_fail:
            lost += progress - durable
            progress, since, pending = durable, 0.0, []
            failures += 1
            t, spent, extra = _recover(inp, rng, t, wall)
            recovering += spent
            failures += extra
            next_fail = t + rng.expovariate(1 / mtbf)
            continue
        # Snapshot: training blocks; the checkpoint becomes durable after the upload.
        block = min(inp.snapshot_s, next_fail - t, wall - t)
        t += block
        blocked += block
        since = 0.0
        if block == inp.snapshot_s:
            pending.append((t + inp.upload_s, progress))
    durable = _settle(pending, t, durable)
    return SimResult(wall, progress, failures, lost, recovering, blocked)


def _settle(pending: list[tuple[float, float]], t: float, durable: float) -> float:
    """Checkpoints whose upload finished by ``t`` become the durable point."""
    while pending and pending[0][0] <= t:
        durable = pending.pop(0)[1]
    return durable


def _recover(inp: SimInputs, rng: random.Random, t: float, wall: float) -> tuple[float, float, int]:
    """Time a recovery takes from ``t``; a failure during it starts it again.
    Returns (time it ends, time spent, failures during it)."""
    start, extra, mtbf = t, 0, inp.mtbf_s
    while t < wall:
        need = inp.detect_s + inp.diagnose_s + inp.restart_s
        if rng.random() > inp.auto_fraction:
            need += inp.manual_s
        hit = rng.expovariate(1 / mtbf)
        if hit >= need:
            t += need
            break
        t += hit
        extra += 1
    t = min(t, wall)
    return t, t - start, extra


@dataclass
class Estimate:
    """Mean ETT over several seeds, with the analytic figure beside it."""

    inputs: SimInputs
    interval_s: float
    ett_mean: float
    ett_min: float
    ett_max: float
    failures_mean: float
    analytic: float
    """Young/Daly first-order ETT at the same interval and mean recovery."""


def estimate(inp: SimInputs, seeds: int = 20) -> Estimate:
    runs = [simulate(inp, seed) for seed in range(seeds)]
    etts = [r.ett for r in runs]
    tau = inp.chosen_interval_s()
    # The checkpoint is lost until uploaded, so the work at risk per failure is τ/2 + upload.
    analytic = effective_fraction(tau, inp.snapshot_s, inp.mean_recovery_s + inp.upload_s,
                                  inp.mtbf_s)
    return Estimate(inp, tau, sum(etts) / len(etts), min(etts), max(etts),
                    sum(r.failures for r in runs) / len(runs), analytic)
