"""detect/onset.py: a finding is dated by when its problem began inside the window, not by the
window's first row (which lies before the fault)."""

import numpy as np
import pytest

from mscale.watch.detect.onset import onset_step

STEPS = np.arange(6, 14)  # a window of 8 judged rows found at step 13


def flags(text: str) -> np.ndarray:
    """``"..SS"`` → per row, slow (S) or not (.)."""
    return np.array([c == "S" for c in text])


@pytest.mark.parametrize("rows,onset", [
    ("....SSSS", 10),  # slow from step 10: the window's start (6) is four steps early
    ("....SS.S", 10),  # one row of jitter inside the fault does not move the onset after it
    ("....SSS.", 10),  # nor a newest row that happened to be fast
    (".S..SSSS", 10),  # one stray slow row before the fault does not move it back
    ("SSSSSSSS", 6),   # slow before the window began: its first row is all that is known
    ("..S.SSSS", 10),  # step 8 or 10 fit as well: the later, never earlier than the fault
])
def test_the_onset_is_the_start_of_the_slow_stretch(rows, onset):
    assert onset_step(STEPS, flags(rows)) == onset


def test_a_window_without_a_slow_row_is_dated_by_its_first_row():
    assert onset_step(STEPS, flags("........")) == 6


def test_the_level_weighs_slow_rows_against_the_others():
    """A moving-replica imbalance shows in only some rows: at level 0.25 one slow row outweighs
    three others, so the stretch reaches back over the gaps of an imbalance; at 0.5 it does not."""
    rows = flags("....S..S..S.S.S.")
    steps = np.arange(20, 36)
    assert onset_step(steps, rows, level=0.25) == 24
    assert onset_step(steps, rows, level=0.5) == 34


def test_steps_need_not_be_consecutive():
    """Masked rows (GC, checkpoint, spikes) are not in the window: the step numbers are."""
    assert onset_step(np.array([6, 7, 9, 12, 13, 15]), flags("..SSSS")) == 9
