"""What differs between a checkpoint and the run resuming from it, said before the first step.

A resume continues the data by position (global samples consumed) and the learning rate by
step, under whatever data and schedule the resuming run has. Both can change without any error:

- **the data**: a data folder re-prepared at the same path (a new tokenizer, more documents),
  or new blend weights, makes the same position mean other samples; the checkpoint records a
  checksum of the first sample (`data.source_fingerprint`). A run directory resuming its own
  checkpoint (``--resume auto``, or one of its own ``ckpt/`` named: what recover and supervise
  relaunch, a rollback included) refuses a change: that is a crash-restart, and it must train on
  what it trained on. ``--allow-data-change``, or a new run directory started from another
  run's checkpoint (``--resume OTHER/ckpt/step-N``), is the operator saying the change is meant:
  then it is one line and an event.
- **the learning rate**: the schedule is a function of ``training.steps``; resuming with another
  ``--steps`` stretches or squeezes the cosine, so the rate jumps (a 20-step run extended to 40
  restarts from ~6× its last rate). Meant or not, the operator sees the jump before it trains.
"""

from __future__ import annotations

import math
import os

from mscale.config.training import TrainingConfig
from mscale.errors import MscaleError
from mscale.train.schedule import learning_rate


def resume_notes(state, training: TrainingConfig, fingerprint: int | None, own: bool,
                 checkpoint: str, data_change: bool = False) -> list[str]:
    """Lines to print for a resume from ``state`` (a manifest's TrainState); MscaleError when
    the data changed under a restart. ``own``: the checkpoint is the run directory's own
    (`is_own`); ``data_change``: ``--allow-data-change`` (the change is meant)."""
    notes = []
    saved = state.data_fingerprint
    if saved is not None and fingerprint is not None and saved != fingerprint:
        what = (f"the training data differ from what {checkpoint} trained on (first sample's "
                f"checksum {saved}, now {fingerprint})")
        if own and not data_change:
            raise MscaleError(what, field="training.data",
                              fix="restore the data that run trained on, or pass "
                                  "--allow-data-change to go on with the new data on purpose")
        notes.append(f"{what}: continuing at global sample {state.samples} of the new data, "
                     "so samples may repeat or be skipped (docs/data.md)")
    if state.lr is not None and 0 < state.step < training.steps:  # past the end: nothing trains
        had = state.lr
        planned = learning_rate(training, state.step - 1)
        if not math.isclose(had, planned, rel_tol=1e-6, abs_tol=1e-12):
            notes.append(f"the learning rate jumps: step {state.step} trained at {had:.3g}, this "
                         f"run's schedule ({training.steps} steps) has {planned:.3g} there and "
                         f"{learning_rate(training, state.step):.3g} next (the schedule follows "
                         "training.steps; keep --steps to continue the same curve)")
    return notes


def is_own(checkpoint: str, ckpt_root: str) -> bool:
    """Whether ``checkpoint`` lies in the run directory's own ``ckpt/`` (a local path or a URL):
    a restart of this run, whether ``--resume auto`` found it or recover named it (a rollback)."""
    def norm(p: str) -> str:
        p = p.removeprefix("file://")
        return (p if "://" in p else os.path.abspath(p)).rstrip("/")

    return norm(checkpoint).startswith(norm(ckpt_root) + "/")
