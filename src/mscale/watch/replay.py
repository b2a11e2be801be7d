"""Replay one training step through the pipeline schedule the engine ran.

The what-if of a straggler (whatif.py) asks how long a step would take if the suspect were
typical. A closed formula for the pipeline (slowest stage plus the others' fill and drain) is
right for equal stages and wrong by tens of points for one slow cell: the schedule decides how
much of a stage's extra time the other stages hide. So the step is replayed action by action:
every forward and backward of every micro-batch (and chunk) on every pipeline rank, in the
order of `parallel.pipeline.schedule` (the same function the engine executes), each starting
when its rank is free and the activation or gradient it needs has arrived. That is the
dependency simulation of ByteDance's straggler study (OSDI 2025, "Understanding Stragglers in
Large Model Training Using What-if Analysis"), at the resolution the records give.

A record has each rank's busy seconds per step, not per action, so a rank's time is spread over
its actions as the engine spends it: a backward costs twice a forward (two matrix products per
weight instead of one), every micro-batch and chunk alike. Transfers are not replayed: their
time is the same with and without the straggler, and only differences of replays are used.

The graph depends only on (pp, vpp, micro-batches); its actions are grouped in levels (every
action's inputs lie in earlier levels), so one replay is a short Python loop over levels of
numpy operations on every row and replica at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mscale.parallel.pipeline.schedule import check_micro_batches, needs, produces, schedule


@dataclass(frozen=True)
class StepGraph:
    """A pipeline step's actions as arrays, ready to replay."""

    pp: int
    vpp: int
    micro_batches: int
    stage: np.ndarray
    """[A] the pipeline rank running each action."""
    weight: np.ndarray
    """[A] the action's share of its rank's busy time in the step (backward = 2 x forward)."""
    levels: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    """Per level: (actions, the previous action on the same rank, the action whose message it
    needs); index A stands for "none" (an end time of zero)."""
    last: np.ndarray
    """[pp] each rank's last action."""
    keys: tuple[tuple[int, str, int, int], ...] = ()
    """Each action's (pipeline rank, "F" or "B", micro-batch, chunk), to match traced events."""

    @property
    def actions(self) -> int:
        return len(self.stage)


MAX_MICRO_BATCHES = 256
"""Most micro-batches replayed: beyond, the fill and drain are under (pp - 1) / 256 of the step
while the replay's cost keeps growing with the count."""


def schedulable(pp: int, vpp: int, micro_batches: float) -> int:
    """The nearest micro-batch count the engine accepts (an estimate from the bubble may be
    fractional or too small): at least pp, a multiple of pp when interleaved, at most
    `MAX_MICRO_BATCHES` (rounded up to that multiple)."""
    m = max(pp, min(int(round(micro_batches)), MAX_MICRO_BATCHES))
    if vpp > 1:
        m = -(-m // pp) * pp
    return m


@lru_cache(maxsize=32)
def step_graph(pp: int, vpp: int, micro_batches: int) -> StepGraph:
    """The dependency graph of one step of (interleaved) 1F1B."""
    reason = check_micro_batches(pp, vpp, micro_batches)
    if reason:
        raise ValueError(reason)
    scheds = [schedule(pp, vpp, micro_batches, r) for r in range(pp)]
    ids: dict[tuple[int, int], int] = {}
    for r in range(pp):
        for i in range(len(scheds[r])):
            ids[r, i] = len(ids)
    total = len(ids)
    made = {produces(a, r, pp, vpp): ids[r, i] for r in range(pp)
            for i, a in enumerate(scheds[r])}
    stage = np.empty(total, np.int64)
    weight = np.empty(total)
    prev = np.full(total, total, np.int64)
    dep = np.full(total, total, np.int64)
    per_rank = 3.0 * micro_batches * vpp  # forward 1, backward 2, per micro-batch and chunk
    for (r, i), k in ids.items():
        a = scheds[r][i]
        stage[k], weight[k] = r, (1.0 if a.forward else 2.0) / per_rank
        if i:
            prev[k] = ids[r, i - 1]
        msg = needs(a, r, pp, vpp)
        if msg is not None:
            dep[k] = made[msg]
    depth = _depths(prev, dep, _topological(scheds, ids, dep))
    levels = tuple((idx, prev[idx], dep[idx]) for idx in
                   (np.flatnonzero(depth == d) for d in range(int(depth.max()) + 1)))
    last = np.array([ids[r, len(scheds[r]) - 1] for r in range(pp)])
    keys = tuple((r, scheds[r][i].kind, scheds[r][i].micro, scheds[r][i].chunk)
                 for r, i in ids)  # in action order: ids were numbered as inserted
    return StepGraph(pp, vpp, micro_batches, stage, weight, levels, last, keys)


def _topological(scheds, ids: dict, dep: np.ndarray) -> list[int]:
    """Every action after its inputs: each rank runs ahead until it needs a message not yet
    made (`schedule.simulate`'s loop; the schedules are deadlock-free, a unit test proves it)."""
    pos, done, order = [0] * len(scheds), set(), []
    while len(order) < len(ids):
        for r, actions in enumerate(scheds):
            while pos[r] < len(actions):
                k = ids[r, pos[r]]
                if dep[k] != len(ids) and dep[k] not in done:
                    break
                order.append(k)
                done.add(k)
                pos[r] += 1
    return order


def _depths(prev: np.ndarray, dep: np.ndarray, order: list[int]) -> np.ndarray:
    """Longest chain of inputs before each action: its level."""
    total = len(prev)
    depth = np.zeros(total + 1, np.int64)
    depth[total] = -1
    for k in order:
        depth[k] = max(depth[prev[k]], depth[dep[k]]) + 1
    return depth[:total]


def replay_actions(graph: StepGraph, durations: np.ndarray) -> np.ndarray:
    """``[A, ...]`` seconds of every action → ``[...]`` the step's pipeline time (the last end
    on any rank), for every trailing index at once. Actions come first so that a level's
    gather reads whole contiguous rows."""
    ends = np.zeros((graph.actions + 1,) + durations.shape[1:])
    for idx, prev, dep in graph.levels:
        ends[idx] = np.maximum(ends[prev], ends[dep]) + durations[idx]
    return ends[graph.last].max(axis=0)


def replay(graph: StepGraph, busy: np.ndarray) -> np.ndarray:
    """``[..., pp]`` busy seconds of each pipeline rank in a step → ``[...]`` the step's
    pipeline time, the busy time spread over the rank's actions (module docstring). Each
    level's durations are made as it is replayed: the whole ``[A, ...]`` array is never built."""
    busy = np.moveaxis(np.asarray(busy, float), -1, 0)  # [pp, ...]
    shape = (-1,) + (1,) * (busy.ndim - 1)
    ends = np.zeros((graph.actions + 1,) + busy.shape[1:])
    for idx, prev, dep in graph.levels:
        took = busy[graph.stage[idx]] * graph.weight[idx].reshape(shape)
        ends[idx] = np.maximum(ends[prev], ends[dep]) + took
    return ends[graph.last].max(axis=0)
