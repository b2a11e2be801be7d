"""What watch keeps of a run for its view and report, in memory that stays flat over any run.

A run of a million steps at 12,288 ranks cannot be kept step by step (two per-rank vectors a
step is 100 KB, so 100 GB), and a figure cannot show more columns than it has pixels anyway.
`Binned` keeps at most ``cols`` columns of running sums: when they fill up, neighbouring columns
are merged in pairs and each column then covers twice as many steps. Memory is fixed from the
first record; the newest steps are never merged away before older ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mscale.watch.layout import JobLayout
from mscale.watch.window import SCALARS, Window


class Binned:
    """Means of ``dim`` values over step bins; at most ``cols`` bins (module docstring)."""

    def __init__(self, dim: int, cols: int, dtype=np.float64):
        if cols < 2 or cols % 2:
            raise ValueError("cols must be an even number >= 2")
        self.sum = np.zeros((cols, dim), dtype)
        self.count = np.zeros(cols, np.int64)
        self.first = np.zeros(cols, np.int64)
        self.last = np.zeros(cols, np.int64)
        self.width = 1
        """Steps per bin (a power of two)."""
        self.used = 0
        """Bins holding data; the last may be partly filled."""

    def add(self, step: int, row: np.ndarray) -> None:
        if self.used and self.count[self.used - 1] < self.width:
            i = self.used - 1
        else:
            if self.used == len(self.count):
                self._halve()
            i = self.used
            self.used += 1
            self.sum[i], self.count[i], self.first[i] = 0, 0, step
        self.sum[i] += row
        self.count[i] += 1
        self.last[i] = step

    def _halve(self) -> None:
        """Merge bins in pairs: memory stays fixed, resolution halves."""
        half = len(self.count) // 2
        self.sum[:half] = self.sum[0::2] + self.sum[1::2]
        self.count[:half] = self.count[0::2] + self.count[1::2]
        self.first[:half], self.last[:half] = self.first[0::2], self.last[1::2]
        self.sum[half:], self.count[half:] = 0, 0
        self.used, self.width = half, self.width * 2

    def means(self) -> np.ndarray:
        """``[used, dim]`` means of the bins."""
        n = np.maximum(self.count[: self.used], 1)[:, None]
        return self.sum[: self.used] / n

    def steps(self) -> np.ndarray:
        """``[used]`` the last step of each bin (the x axis of a curve)."""
        return self.last[: self.used].copy()


class History:
    """Scalars (loss, grad norm, throughput, ...) and per-rank compute/wait of a run so far."""

    def __init__(self, world: int, scalar_cols: int = 2048, rank_cols: int = 240):
        self.world = world
        self.scalars = Binned(len(SCALARS), scalar_cols)
        self.ranks = Binned(2 * world, rank_cols, np.float32)
        """Per bin: compute time of every rank, then comm wait of every rank."""
        self.latest: dict[str, float] = {}
        """The newest record's scalars, plus ``step`` and the median step time."""
        self.evals: list[tuple[int, float]] = []
        """(step, held-out loss) of every evaluation: a few per thousand steps, kept whole."""

    def add(self, window: Window) -> None:
        """Append the rows of a window (one Python iteration per step, none per rank)."""
        if not len(window):
            return
        compute, wait = window.per_rank("compute_time"), window.per_rank("comm_wait")
        for i, step in enumerate(window.steps.tolist()):
            with np.errstate(invalid="ignore"):
                self.scalars.add(step, window.scalars[i])
            self.ranks.add(step, np.concatenate([compute[i], wait[i]]))
        self.latest = {name: float(window.scalars[-1, j]) for j, name in enumerate(SCALARS)}
        col = window.scalars[:, SCALARS.index("eval_loss")]
        self.evals += [(int(s), float(v)) for s, v in zip(window.steps[np.isfinite(col)],
                                                          col[np.isfinite(col)])]
        if self.evals:
            self.latest["eval_loss"] = self.evals[-1][1]
        self.latest["step"] = int(window.steps[-1])
        self.latest["step_time"] = float(np.median(window.per_rank("step_time")[-1]))

    def scalar(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one scalar, binned."""
        return self.scalars.steps(), self.scalars.means()[:, SCALARS.index(name)]

    def heat(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, ``[world, bins]``) of ``compute`` or ``wait`` per rank, for the heat map."""
        m = self.ranks.means()
        part = m[:, : self.world] if which == "compute" else m[:, self.world:]
        return self.ranks.steps(), part.T


@dataclass(frozen=True)
class AttemptHistory:
    """One attempt of the job as the report shows it: its records, on its own layout. A re-plan
    (recover relaunched on fewer nodes) changes the ranks and nodes, and the attempt before it
    is the one whose heat map shows the straggler."""

    number: int | None
    """The attempt's number from its ``start`` event; None when no event names it."""
    history: History
    layout: JobLayout | None

    def label(self) -> str:
        """``attempt 1: tp 2 × pp 2 × dp 2 on node1, node2, node3, node4 (steps 1–15)``."""
        steps = self.history.ranks.steps()
        which = f"attempt {self.number}" if self.number is not None else "an attempt"
        span = f" (steps {steps[0]}–{steps[-1]})" if len(steps) else ""
        lay = self.layout
        if lay is None:
            return which + span
        names = list(lay.node_names) if lay.named else []
        where = (", ".join(names[:16]) + (f" (+{len(names) - 16})" if len(names) > 16 else "")
                 if names else f"{len(lay.node_names)} unnamed node(s)")
        return f"{which}: tp {lay.tp} × pp {lay.pp} × dp {lay.dp} on {where}{span}"
