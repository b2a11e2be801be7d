"""The best integer split of a model's blocks over pipeline stages, from measured stage times.

Stage-imbalance advice is only worth giving when some split the planner can make is faster:
blocks are whole, and the first and last stages carry the embedding, and the head and loss, which
no block count removes. So the advice is checked against the best integer split under a simple
model fitted to the measured stage compute times ``t_s`` and block counts ``k_s``:

    t_s = e_s + k_s * c

``c`` (seconds per block) is taken as the smallest ``t_s / k_s``: every stage's fixed part
``e_s`` is then >= 0, and the stage with the least fixed work per block sets it. Moving blocks
changes only the ``k_s * c`` part. The makespan (the slowest stage, which paces a 1F1B pipeline)
is minimised by handing out blocks one at a time to the stage that would be fastest with one
more: with equal increments that greedy choice is optimal.

Splits with the same slowest stage are not equally fast: where the heavy stage sits decides how
much of it the schedule hides (a heavy first stage hides in the fill, a heavy middle one does
not). `fastest_split` starts from the greedy split and moves one block at a time while the
replayed step (watch/replay.py) gets shorter.
"""

from __future__ import annotations

import numpy as np

from mscale.watch.replay import StepGraph, replay


def best_split(stage_s: np.ndarray, counts: list[int]) -> tuple[list[int], float]:
    """(the split with the smallest slowest stage, seconds per block). Middle stages keep at
    least one block (config/layout.py: split_problem); on a tie the current split is kept."""
    t = np.asarray(stage_s, dtype=float)
    k = np.asarray(counts, dtype=float)
    have = k > 0
    if not have.any():
        return list(counts), 0.0
    c = float(np.min(t[have] / k[have]))
    fixed = t - k * c
    n = len(counts)
    split = [0 if i in (0, n - 1) else 1 for i in range(n)]
    for _ in range(sum(counts) - sum(split)):
        after = fixed + (np.asarray(split) + 1) * c
        split[int(np.argmin(after))] += 1
    current = float(np.max(t))
    best = float(np.max(fixed + np.asarray(split) * c))
    if best >= current - 1e-12 * max(current, 1.0):
        return list(counts), c
    return split, c


def fastest_split(stage_s: np.ndarray, counts: list[int], graph: StepGraph
                  ) -> tuple[list[int], float]:
    """`best_split`, then single-block moves while the replayed step gets shorter (module
    docstring). Returns the current split when nothing replays faster than it."""
    t = np.asarray(stage_s, dtype=float)
    split, c = best_split(t, counts)
    if c <= 0:
        return list(counts), c
    fixed = t - np.asarray(counts, dtype=float) * c
    n = len(counts)

    def valid(k: list[int]) -> bool:
        return min(k) >= 0 and all(k[i] >= 1 for i in range(1, n - 1))

    best, best_s = list(split), float(replay(graph, fixed + np.asarray(split) * c))
    while True:
        moves = [k for i in range(n) for j in range(n) if i != j
                 for k in [[b - (x == i) + (x == j) for x, b in enumerate(best)]] if valid(k)]
        if not moves:
            break
        times = replay(graph, fixed + np.asarray(moves, dtype=float) * c)
        i = int(np.argmin(times))
        if times[i] >= best_s * (1 - 1e-9):
            break
        best, best_s = moves[i], float(times[i])
    now = float(replay(graph, t))
    return (list(counts), c) if best_s >= now * (1 - 1e-9) else (best, c)


def split_gain_pct(stage_s: np.ndarray, counts: list[int], split: list[int], per_block: float,
                   graph: StepGraph) -> float:
    """How much slower the replayed step is with ``counts`` than with ``split``, in percent,
    on the typical stage times alone: the advice must pay without the window's noise."""
    t = np.asarray(stage_s, dtype=float)
    moved = t + (np.asarray(split, dtype=float) - np.asarray(counts, dtype=float)) * per_block
    now, then = float(replay(graph, t)), float(replay(graph, moved))
    return 100.0 * (now / then - 1.0) if then > 0 else 0.0
