"""What fixing a straggler would buy: the step time if the named ranks were typical.

After the what-if analysis of ByteDance's straggler study (OSDI 2025, "Understanding Stragglers
in Large Model Training Using What-if Analysis"): replace the suspect's durations by those of a
typical peer, recompute the step from the job's dependency structure, compare. The structure:

- a tensor-parallel group synchronises at every layer, so it runs at its slowest member;
- the pipeline is replayed action by action through the schedule the engine ran (replay.py:
  every forward and backward of every micro-batch, each waiting for its rank and its input), so
  how much of one slow stage the others hide is computed, not assumed;
- data-parallel replicas meet in the gradient reduction, so the step waits for the slowest one.

Communication that everyone pays (the reduction itself, TP collectives) is the same with or
without the straggler and cancels: only the difference of the two replayed step times is used,
subtracted from the measured step time. The slowdown is then ``T / (T - saved) - 1``, the
paper's ratio of actual to straggler-free time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.watch.layout import JobLayout
from mscale.watch.replay import StepGraph, replay, schedulable, step_graph


class Grid:
    """A layout's per-rank coordinates as cached arrays, and the reshapes the rules share.

    Ranks are ordered tp fastest, then dp, then pp (topology/placement.py), so ``[..., world]``
    reshapes to ``[..., pp, dp, tp]`` and a pipeline stage is a contiguous block of ranks.
    """

    def __init__(self, layout: JobLayout):
        self.layout = layout
        self.pp, self.dp, self.tp, self.world = layout.pp, layout.dp, layout.tp, layout.world
        self.stage = layout.pp_rank
        self.replica = layout.dp_rank
        self.tp_rank = layout.tp_rank
        self.node = np.minimum(layout.node, len(layout.node_names) - 1)
        self.nodes = len(layout.node_names)
        self.node_size = np.bincount(self.node, minlength=self.nodes)
        self.reader = self.tp_rank == 0
        """TP rank 0 reads the batch and broadcasts it to its TP peers (train/data.py)."""

    def grid(self, x: np.ndarray) -> np.ndarray:
        """``[..., world]`` → ``[..., pp, dp, tp]``."""
        return x.reshape(*x.shape[:-1], self.pp, self.dp, self.tp)

    def stage_median(self, x: np.ndarray) -> np.ndarray:
        """``[..., world]`` → ``[..., pp]``: the median rank of each stage."""
        return np.median(x.reshape(*x.shape[:-1], self.pp, self.dp * self.tp), axis=-1)

    def per_rank(self, per_stage: np.ndarray) -> np.ndarray:
        """``[..., pp]`` → ``[..., world]``: each rank gets its stage's value."""
        return per_stage[..., self.stage]

    def reader_median(self, x: np.ndarray) -> np.ndarray:
        """``[..., world]`` → ``[..., pp, tp]``: the median over DP replicas of each TP position
        of each stage (the peers that do exactly the same work, data loading included)."""
        return np.median(self.grid(x), axis=-2)

    def name(self, node: int) -> str:
        return self.layout.node_names[node]

    def node_ranks(self, node: int) -> list[int]:
        return np.flatnonzero(self.node == node).tolist()


def stage_times(own: np.ndarray, grid: Grid) -> np.ndarray:
    """``[n, world]`` busy seconds → ``[n, pp, dp]``: each TP group runs at its slowest member."""
    return grid.grid(own).max(axis=-1)


def model_step(own: np.ndarray, grid: Grid, micro_batches: float) -> np.ndarray:
    """``[n, world]`` busy seconds → ``[n]`` the replayed step time (module docstring)."""
    x = stage_times(own, grid)                                         # [n, pp, dp]
    if grid.pp == 1:
        return x[:, 0].max(axis=-1)
    vpp = grid.layout.vpp
    graph = step_graph(grid.pp, vpp, schedulable(grid.pp, vpp, micro_batches))
    return replay(graph, np.moveaxis(x, 1, -1)).max(axis=-1)


def estimate_micro_batches(own: np.ndarray, bubble: np.ndarray, grid: Grid) -> float | None:
    """Micro-batches per step from the bubble, or None when the data cannot tell.

    The slowest stage of a replica idles about ``(sum - max) / m``: it never waits for a
    neighbour in the steady state, only while the pipeline fills and drains (exact for equal
    stages under 1F1B). Only for metrics without a plan: a plan says ``m``."""
    if grid.pp == 1 or len(own) == 0:
        return None
    x = stage_times(own, grid)
    slowest = x.argmax(axis=1)[:, None, :]
    b = np.take_along_axis(np.median(grid.grid(bubble), axis=-1), slowest, axis=1)[:, 0]
    rest = x.sum(axis=1) - x.max(axis=1)
    ok = (b > 1e-6) & (rest > 0)
    if not ok.any():
        return None
    return float(np.clip(np.median(rest[ok] / b[ok]), 1.0, 4096.0))


@dataclass
class WhatIf:
    """Slowdowns of a window of rows under the layout's step model."""

    grid: Grid
    micro_batches: float

    @property
    def graph(self) -> StepGraph:
        """The step the engine ran, as a graph to replay (pp > 1)."""
        g = self.grid
        return step_graph(g.pp, g.layout.vpp, schedulable(g.pp, g.layout.vpp, self.micro_batches))

    def slowdown(self, own: np.ndarray, fixed: np.ndarray, step_time: np.ndarray
                 ) -> tuple[float, float]:
        """(percent, seconds saved per step) of fixing ``own`` into ``fixed`` (both ``[n, world]``);
        medians over the rows, so one odd row does not decide."""
        saved = model_step(own, self.grid, self.micro_batches) - model_step(
            fixed, self.grid, self.micro_batches)
        return self.from_saving(float(np.median(saved)), float(np.median(step_time)))

    @staticmethod
    def from_saving(saved: float, step_time: float) -> tuple[float, float]:
        saved = max(0.0, saved)
        rest = step_time - saved
        if rest <= 0:
            return 0.0, 0.0
        return 100.0 * saved / rest, saved

    def typical_ranks(self, compute: np.ndarray, data: np.ndarray, ranks,
                      typical_compute: np.ndarray | None = None,
                      typical_data: np.ndarray | None = None) -> np.ndarray:
        """Busy seconds with ``ranks`` computing like a typical rank of their stage and loading
        data like a typical DP peer at the same TP position. ``typical_*``: ``[n, world]``
        values of a typical peer of each rank (default: the median peer)."""
        g = self.grid
        ranks = np.asarray(ranks, np.int64)
        if typical_compute is None:
            typical_compute = g.per_rank(g.stage_median(compute))
        if typical_data is None:
            typical_data = g.reader_median(data)[:, g.stage, g.tp_rank]
        c, d = compute.copy(), data.copy()
        c[:, ranks] = typical_compute[:, ranks]
        d[:, ranks] = typical_data[:, ranks]
        return c + d

    def typical_stage(self, compute: np.ndarray, data: np.ndarray, stage: int,
                      typical: np.ndarray | None = None) -> np.ndarray:
        """Busy seconds with every rank of ``stage`` shifted down by what a typical rank of it
        computes beyond the median of the other stages' (its ranks keep their differences, so
        a straggler inside the stage is not credited to the split)."""
        g = self.grid
        typical = g.stage_median(compute) if typical is None else typical
        others = np.median(np.delete(typical, stage, axis=1), axis=1)
        c = compute.copy()
        c[:, g.stage == stage] -= np.maximum(typical[:, stage] - others, 0.0)[:, None]
        return c + data

    def typical_all(self, compute: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Busy seconds with the work spread evenly over the DP replicas, row by row: each
        replica loses what its median rank does beyond its DP peers (its ranks keep their own
        noise, which no rebalancing removes)."""
        own = compute + data
        return own - np.maximum(replica_excess(own, self.grid), 0.0)[:, self.grid.replica]


def replica_excess(own: np.ndarray, grid: Grid) -> np.ndarray:
    """``[..., world]`` → ``[..., dp]``: how much longer each replica's median rank is busy than
    its DP peers (same stage, same TP position). One rank's hiccup does not move it."""
    excess = own - grid.reader_median(own)[..., grid.stage, grid.tp_rank]
    return np.median(grid.grid(excess), axis=(-3, -1))
