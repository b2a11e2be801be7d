"""The judged rows of a run: a ring of fixed size, so memory stays flat over any run length.

Only rows the per-rank rules may look at enter: warm-up, flagged checkpoint/GC steps and
every-rank-at-once spikes stay out (`Masker`). A row keeps each rank's compute, data, wait
(communication wait + bubble) and bubble seconds as float32 (12,288 ranks x 32 rows is 6 MB),
plus what the per-step rules need, computed once when it enters.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.whatif import Grid, replica_excess

MAD_SIGMA = 1.4826
"""MAD x 1.4826 estimates the standard deviation of normal data; the median and the MAD ignore
up to half of the values being outliers, which a mean and a standard deviation do not."""


def median(x, axis: int | None = None, keepdims: bool = False):
    """``np.median(x, axis, keepdims=keepdims)``, the same value bit for bit, at a third of its
    fixed cost: the watcher takes dozens of medians of small arrays per record, where numpy's
    dispatch, not the work, was most of a `evaluate` run's time. Float arrays only go this way
    (the same partition and NaN rule as numpy: the middle one or two order statistics, their
    mean in the array's dtype; NaN where the slice holds a NaN); anything else is numpy's."""
    a = np.asarray(x)
    if a.dtype.kind != "f" or a.size == 0 or (axis is not None and a.ndim == 0):
        return np.median(a, axis=axis, keepdims=keepdims)
    shape = a.shape
    if axis is None:
        a, ax = a.reshape(-1), 0
    else:
        ax = axis + a.ndim if axis < 0 else axis
    n = a.shape[ax]
    lo_i, hi_i = (n - 1) // 2, n // 2
    part = np.partition(a, sorted({lo_i, hi_i, n - 1}), axis=ax)
    lo = part.take(lo_i, axis=ax)
    med = lo if lo_i == hi_i else (lo + part.take(hi_i, axis=ax)) / 2
    nan = np.isnan(part.take(n - 1, axis=ax))  # NaN sorts last
    if np.ndim(med) == 0:
        med = a.dtype.type(np.nan) if nan else med
    elif nan.any():
        med = np.where(nan, np.array(np.nan, med.dtype), med)
    if keepdims:
        med = np.reshape(med, (1,) * len(shape)) if axis is None else np.expand_dims(med, ax)
    return med


def robust_sigma(x: np.ndarray, axis=None) -> np.ndarray:
    """Robust spread of ``x`` around its median."""
    med = median(x, axis=axis, keepdims=True)
    return MAD_SIGMA * median(np.abs(x - med), axis=axis)


@dataclass
class Recent:
    """The last rows of `Rows`, oldest first: ``[k, world]`` float32 arrays and ``[k]`` scalars."""

    steps: np.ndarray
    compute: np.ndarray
    data: np.ndarray
    wait: np.ndarray
    bubble: np.ndarray
    step_time: np.ndarray
    """The record's step time (the slowest rank's)."""
    tokens_per_s: np.ndarray
    top_excess: np.ndarray
    """Per row: the largest busy-time excess of a rank over its DP peers (imbalance rule)."""
    top_threshold: np.ndarray
    """Per row: the excess that counts as one clearly slow replica in that row."""
    top_replica: np.ndarray
    """Per row: the DP replica of the rank with the largest excess."""

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def own(self) -> np.ndarray:
        """Busy seconds: compute + data (what a rank does by itself, not waiting)."""
        return self.compute + self.data


class Rows:
    """Ring buffer of the judged rows."""

    def __init__(self, grid: Grid, config: WatchConfig, capacity: int):
        self.grid, self.config, self.cap = grid, config, capacity
        self.ranks = np.zeros((capacity, 4, grid.world), np.float32)
        self.scalars = np.zeros((capacity, 6))
        self.n = 0
        """Rows appended since the last `clear` (the ring holds the last ``capacity``)."""

    def clear(self) -> None:
        self.n = 0

    def append(self, step: int, compute, data, wait, bubble, step_time: float,
               tokens_per_s: float) -> None:
        i = self.n % self.cap
        self.ranks[i, 0], self.ranks[i, 1] = compute, data
        self.ranks[i, 2], self.ranks[i, 3] = wait, bubble
        self.scalars[i, :3] = step, step_time, tokens_per_s
        self.scalars[i, 3:] = self._top(compute + data, step_time)
        self.n += 1

    def _top(self, own: np.ndarray, step_time: float) -> tuple[float, float, float]:
        """The row's slowest DP replica against its peers, and the bar for 'clearly slow'
        (detect/imbalance.py)."""
        g = self.grid
        replica = replica_excess(own, g)
        excess = g.grid(own - g.reader_median(own)[g.stage, g.tp_rank])  # [pp, dp, tp]
        inside = excess - replica[None, :, None]
        noise = float(robust_sigma(inside if g.pp * g.tp > 1 else excess))
        noise /= np.sqrt(g.pp * g.tp)  # a replica's median averages out its ranks' noise
        top = int(replica.argmax())
        bar = max(self.config.step_z * noise, self.config.min_excess_frac * step_time)
        return float(replica[top]), bar, float(top)

    def last(self, k: int) -> Recent:
        k = min(k, self.n, self.cap)
        idx = np.arange(self.n - k, self.n) % self.cap
        r, s = self.ranks[idx], self.scalars[idx]
        return Recent(steps=s[:, 0].astype(np.int64), compute=r[:, 0], data=r[:, 1],
                      wait=r[:, 2], bubble=r[:, 3], step_time=s[:, 1], tokens_per_s=s[:, 2],
                      top_excess=s[:, 3], top_threshold=s[:, 4],
                      top_replica=s[:, 5].astype(np.int64))


class Masker:
    """Says which rows the per-rank rules must not see, and why.

    Warm-up: the first ``warmup_steps`` rows after the start or a restart (a step number that
    goes back). Flags: a record whose ``extra`` sets one of ``mask_flags``. Spike: a row where
    the median rank's busy time is ``spike_rel`` above its recent median, i.e. every rank slowed
    at once (a GC pause or a checkpoint snapshot a trainer did not flag). A lasting job-wide
    slowdown is a spike only until the recent median has caught up with it (half of
    ``job_window`` rows), then the job-level rules see it.
    """

    def __init__(self, config: WatchConfig):
        self.config = config
        self.since_start = 0
        self.last_step: int | None = None
        self.recent_own: deque[float] = deque(maxlen=config.job_window)
        self.counts = {"warmup": 0, "flagged": 0, "spike": 0}

    def restarted(self, step: int) -> bool:
        """True when ``step`` does not follow the previous one forward (the job restarted)."""
        back = self.last_step is not None and step <= self.last_step
        self.last_step = step
        if back:
            self.since_start = 0
            self.recent_own.clear()
        return back

    def reason(self, own_median: float, extra: dict | None) -> str | None:
        """Why this row is masked (None: it is judged). Call once per row, in order."""
        self.since_start += 1
        if self.since_start <= self.config.warmup_steps:
            return self._count("warmup")
        if extra and any(extra.get(f) for f in self.config.mask_flags):
            return self._count("flagged")
        ref = float(median(list(self.recent_own))) if len(self.recent_own) >= 3 else None
        self.recent_own.append(own_median)
        if ref is not None and own_median > ref * (1 + self.config.spike_rel):
            return self._count("spike")
        return None

    def _count(self, why: str) -> str:
        self.counts[why] += 1
        return why
