"""The metrics of a run as arrays: what every detector reads.

`metrics.jsonl` holds one record per step with per-rank vectors (config/records.py). Detectors
never loop over ranks in Python: a `Window` holds the last N steps as ``[steps, world]`` float
arrays, so a rule over 12,288 ranks is a handful of numpy reductions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mscale.config.records import LINK_FIELDS, PER_RANK_FIELDS

PER_RANK = PER_RANK_FIELDS
"""Per-rank vectors of a metrics record, in this order in `Window.ranks`."""
LINK_VECTORS = LINK_FIELDS
"""The optional split of communication by kind of traffic: NaN where a record lacks it (another
trainer's), which keeps the slow-link rule silent rather than misled (detect/links.py)."""
REQUIRED_PER_RANK = PER_RANK.index(LINK_VECTORS[0])
"""The vectors before this index are always there (bubble_time read as 0 when absent)."""
SCALARS = ("time", "loss", "grad_norm", "clip_threshold", "lr", "tokens_per_s", "mfu",
           "eval_loss")
"""Per-step scalars (NaN where a record lacks the field: ``eval_loss`` on most steps)."""


@dataclass
class Window:
    """The most recent steps of one run, oldest first."""

    steps: np.ndarray
    """[n] int64: the step number of each row (1-based optimizer steps)."""
    ranks: np.ndarray
    """[n, len(PER_RANK), world] float64 seconds; a missing ``bubble_time`` is 0, a missing
    `LINK_VECTORS` entry NaN."""
    scalars: np.ndarray
    """[n, len(SCALARS)] float64."""
    extra: list[dict] = field(default_factory=list)
    """Each record's ``extra`` dict (checkpoint/GC flags), for rules that mask such steps."""

    @property
    def world(self) -> int:
        return self.ranks.shape[2]

    def __len__(self) -> int:
        return len(self.steps)

    def per_rank(self, name: str) -> np.ndarray:
        """``[n, world]`` view of one per-rank vector."""
        return self.ranks[:, PER_RANK.index(name), :]

    def scalar(self, name: str) -> np.ndarray:
        """``[n]`` view of one scalar."""
        return self.scalars[:, SCALARS.index(name)]

    @classmethod
    def empty(cls, world: int) -> "Window":
        return cls(np.zeros(0, np.int64), np.zeros((0, len(PER_RANK), world)),
                   np.zeros((0, len(SCALARS))), [])
