"""Goodput: how often to checkpoint and how much of the wall time makes progress.

Young/Daly (docs/references.md): the interval that minimises lost time is ``sqrt(2·C·MTBF)`` for a blocking
checkpoint cost C. Expected waste per unit time, to first order: ``C/τ`` for writing checkpoints,
plus, per failure, half an interval of lost work and the restart: ``(τ/2 + R)/MTBF``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mscale.config.plan import CheckpointAdvice
from mscale.errors import MscaleError
from mscale.planner.constants import (CHECKPOINT_BYTES_PER_PARAM, FAILURES_PER_1000_NODE_DAYS,
                                      RESTART_S, SNAPSHOT_GB_PER_S, STORAGE_READ_GB_PER_S,
                                      STORAGE_WRITE_GB_PER_S)


OPTIONS = {"failures_per_1000_node_days": "--failure-rate", "restart_s": "--restart-s",
           "write_gb_per_s": "--ckpt-write-gbps"}
"""The `mscale plan` option that sets each input, for error messages."""


@dataclass(frozen=True)
class GoodputInputs:
    """Failure and storage figures; the defaults are the published ones in constants.py."""

    failures_per_1000_node_days: float = FAILURES_PER_1000_NODE_DAYS
    restart_s: float = RESTART_S
    snapshot_gb_per_s: float = SNAPSHOT_GB_PER_S
    write_gb_per_s: float = STORAGE_WRITE_GB_PER_S
    read_gb_per_s: float = STORAGE_READ_GB_PER_S

    def __post_init__(self) -> None:
        """Refuse what would make the advice undefined: Young/Daly needs a finite, positive
        failure rate (at 0 the interval is infinite) and finite, non-negative times and rates."""
        for name, value in vars(self).items():
            positive = name != "restart_s"
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                kind = f"{'positive' if positive else 'non-negative'} finite number"
                raise MscaleError(f"{value:g} is not a {kind}", field=OPTIONS.get(name, name),
                                  fix=f"give a {kind}, e.g. the default "
                                      f"{getattr(GoodputInputs, name):g}")


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """Checkpoint interval (s) minimising expected lost time: sqrt(2·C·MTBF)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def job_mtbf_s(nodes: int, failures_per_1000_node_days: float) -> float:
    """Mean time between failures of a job on ``nodes`` nodes failing independently."""
    per_day = nodes * failures_per_1000_node_days / 1000
    return math.inf if per_day <= 0 else 86400 / per_day


def effective_fraction(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Share of wall time spent on progress: 1 − C/τ − (τ/2 + R)/MTBF, clipped to [0, 1]."""
    waste = cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s
    return min(1.0, max(0.0, 1 - waste))


def advise(params: float, world: int, nodes: int, step_time_s: float,
           g: GoodputInputs = GoodputInputs(),
           run_steps: int | None = None) -> tuple[CheckpointAdvice, str]:
    """The checkpoint recommendation for a model of ``params`` parameters on ``world`` GPUs.

    The blocking cost is the two-stage checkpoint's snapshot to host memory (each GPU copies its
    own shard); the interval is never shorter than the background write of the whole checkpoint,
    so one upload finishes before the next starts, nor longer than the run (``run_steps``, the
    training file's steps: a tiny failure rate once asked for a 150-digit interval, which no
    train reads). Restart adds loading the checkpoint.
    Returns the advice and a one-line note on what bound the interval.
    """
    total = params * CHECKPOINT_BYTES_PER_PARAM
    cost = total / world / (g.snapshot_gb_per_s * 1e9)
    write = total / (g.write_gb_per_s * 1e9)
    restart = g.restart_s + total / (g.read_gb_per_s * 1e9)
    mtbf = job_mtbf_s(nodes, g.failures_per_1000_node_days)
    tau = young_daly(cost, mtbf)
    note = "Young/Daly sqrt(2·C·MTBF)"
    if tau < write:
        tau, note = write, "raised to the background write time of one checkpoint"
    steps = max(1, round(tau / step_time_s))
    # the cap never goes below the write: an interval shorter than one upload is what the
    # raise above prevents, and preflight would ask the store for more than it can need
    cap = None if run_steps is None else max(run_steps, math.ceil(write / step_time_s))
    if cap is not None and steps > cap:
        steps, note = cap, (f"{note}, capped at the run's {run_steps} steps" if cap == run_steps
                            else f"{note}, capped at one write ({cap} steps; the run is shorter)")
    tau = steps * step_time_s
    eff = effective_fraction(tau, cost, restart, mtbf)
    advice = CheckpointAdvice(interval_steps=steps, interval_s=round(tau, 3),
                              mtbf_h=round(mtbf / 3600, 3), checkpoint_cost_s=round(cost, 4),
                              restart_s=round(restart, 1), effective_training=round(eff, 4))
    return advice, note
