"""When a problem began: the onset inside the window that found it.

A windowed rule names a problem only once it has lasted (most of ``persist_steps`` rows for a
rank, three of four for a link, half of ``imbalance_window`` for a moving replica), so when it is
found the window reaches back before the fault: a rank slow from step 10 is found at step 13 over
rows 6–13. Dating the finding by the window's first row would say the rank was slow at step 6,
and the quarantine evidence would carry steps where the node was healthy. The onset is instead
the first row of the stretch in which the rule's per-row measure was beyond its bar.

A stretch, not a strict run of consecutive slow rows: one row of jitter inside a real fault must
not move the onset to after it, and one spurious slow row in the healthy part before must not
move it back to before. The stretch is the suffix of the window with the largest sum of
``slow - level`` (a CUSUM change point between a healthy level of about no slow rows and a
faulty one of about all): each slow row counts ``1 - level``, each other row ``-level``.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-9
"""Ties between suffix sums (sums of halves are exact, but ``level`` need not be)."""


def onset_step(steps: np.ndarray, slow: np.ndarray, level: float = 0.5) -> int:
    """The step at which the stretch of slow rows ending the window began.

    ``steps``: the window's step numbers, oldest first; ``slow``: per row, whether the rule's
    measure was beyond its bar in that row; ``level``: the share of slow rows halfway between a
    healthy window and a faulty one (0.5 when a fault is slow in nearly every row). The stretch
    starts at a slow row; among equally good starts the latest is taken, so a tie never dates a
    finding earlier than the fault. A window with no slow row at all (the rule decided on the
    window as a whole) is dated by its first row."""
    slow = np.asarray(slow, bool)
    if len(slow) == 0 or not slow.any():
        return int(steps[0])
    gain = np.cumsum((slow - level)[::-1])[::-1]  # gain[i]: sum over rows i.. of slow - level
    gain = np.where(slow, gain, -np.inf)  # a stretch starts at a slow row
    start = np.flatnonzero(gain >= gain.max() - EPS)[-1]
    return int(steps[start])
