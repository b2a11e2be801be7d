"""The stages `decide` strings together, behind one name each.

Why a module of its own: each stage is written separately (diagnose, checkpoints, exclude,
replan, rollback, the checkpoint pins), and `decide` calls them only through these names, so a
test replaces one stage (``monkeypatch.setattr(stages, "diagnose", fake)``) and the order and
arguments of the calls stay in one place.
"""

from __future__ import annotations

from mscale.ckpt import pins
from mscale.recover.checkpoints import choose_checkpoint
from mscale.recover.diagnose import diagnose
from mscale.recover.exclude import decide_exclusions
from mscale.recover.replan import replan
from mscale.recover.rollback import data_skip_for, read_data_skips, record_data_skip
from mscale.runs.rundir import RunDir

__all__ = ["choose_checkpoint", "data_skip_for", "decide_exclusions", "diagnose",
           "pin_checkpoint", "read_data_skips", "record_data_skip", "replan"]


def pin_checkpoint(run: RunDir, path: str, reason: str) -> None:
    """Keep the checkpoint ``path`` out of retention (a ``KEEP`` file in it, `mscale.ckpt.pins`):
    the relaunch's own saves must not push the checkpoint it resumes from out of the window."""
    pins.pin(path, reason, who="recover")
