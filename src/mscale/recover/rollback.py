"""The data window a rollback skips, and its record in ``RUN/data_skip.json``.

A divergence (or a run of gradient spikes) that began at step ``b`` is caused by the batches of
steps near ``b`` meeting the model's state there: replaying them from the checkpoint at step
``s < b`` would most likely diverge again. So the rollback resumes at ``s`` and skips the
batches of steps ``s+1 … b`` inclusive — ``DataSkip(after_step=s, skip_steps=b - s)`` — the
remedy PaLM used on its loss spikes (restart from a checkpoint before the spike, skip the batches
seen before and during it; docs/references.md, "Rollback").

A NaN is different: a first, one-off NaN is as often a transient fault (a bit flip, a flaky
device) as bad data, so the same data is retried; a NaN at the same step in two attempts is
the data, and that window is skipped. ``train`` reads ``data_skip.json`` when it starts; the
windows add up (`mscale.config.records.DataSkips.sample_step`).
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from mscale.config.records import DataSkip, DataSkips
from mscale.errors import MscaleError
from mscale.recover.decision import CheckpointChoice, Diagnosis
from mscale.runs.atomic import fs_and_path, write_json_atomic
from mscale.runs.rundir import RunDir


def data_skip_for(diagnosis: Diagnosis, choice: CheckpointChoice,
                  events: list[dict] | None = None,
                  skips: DataSkips | None = None) -> DataSkip | None:
    """The window to skip after resuming from ``choice``, or None (nothing to skip: not a
    numerics failure, no bad step, or a first NaN that is retried on the same data).

    A NaN counts as repeated when ``events`` (events.jsonl) holds NaN events at the bad step in
    two or more attempts; without ``events``, when the diagnosis did not call it transient.

    ``skips``: the windows the failed attempt ran with. The new window reaches past every
    sample that attempt read up to the bad step, its own earlier windows included (a rollback
    to a checkpoint before an earlier window's: counted in steps from the checkpoint, it
    re-read the batches that had diverged); the windows it passes over are superseded
    (`record_data_skip` drops them)."""
    b = diagnosis.bad_step
    if diagnosis.cls != "numerics" or b is None:
        return None
    if diagnosis.symptom == "nan":
        repeated = (nan_attempts(events, b) >= 2 if events is not None
                    else not diagnosis.transient)
        if not repeated:
            return None
        why = f"NaN at step {b} in two attempts: the data, not a transient fault"
    elif diagnosis.symptom == "divergence":
        why = f"divergence from step {b}: {diagnosis.summary}"
    else:
        return None
    s = choice.step if choice.path is not None and choice.step is not None else 0
    if s >= b:  # choose_checkpoint never returns one; a hand-made choice must not skip nothing
        raise MscaleError(f"the checkpoint at step {s} does not precede the bad step {b}",
                          field="checkpoint", fix="resume from a checkpoint before the bad step")
    skip = b - s
    if skips is not None:  # read up to step sample_step(b); the new run keeps windows <= s
        kept = sum(e.skip_steps for e in skips.entries if e.after_step <= s)
        skip = skips.sample_step(b) - s - kept
    return DataSkip(after_step=s, skip_steps=skip, reason=why[:300], attempt=diagnosis.attempt)


def nan_attempts(events: list[dict], step: int) -> int:
    """How many attempts (stretches between train ``start`` events) recorded a NaN at ``step``."""
    attempts, current = set(), 0
    for ev in events:
        if ev.get("kind") == "start" and ev.get("source", "train") == "train":
            current += 1
        elif ev.get("kind") == "nan" and ev.get("step") == step:
            attempts.add(current)
    return len(attempts)


def read_data_skips(run: RunDir) -> DataSkips:
    """``RUN/data_skip.json``, or an empty record when there is none."""
    fs, path = fs_and_path(run.data_skip)
    if not fs.isfile(path):
        return DataSkips()
    try:
        return DataSkips.model_validate(json.loads(fs.cat_file(path)))
    except (ValueError, ValidationError) as e:
        raise MscaleError(f"unreadable: {str(e).splitlines()[0]}", file=run.data_skip,
                          fix="repair it (train reads it to know which data was skipped); "
                              "never delete it while the run continues") from None


def record_data_skip(run: RunDir, skip: DataSkip) -> bool:
    """Append ``skip`` to ``RUN/data_skip.json`` (read, append, atomic replace); False, and
    nothing written, when a window for the same failed attempt is there already: a window
    recorded twice is skipped twice, and `recover --execute` may run twice on one failure (its
    relaunch never started, or two recoveries at once)."""
    skips = read_data_skips(run)
    if skip.attempt is not None and any(e.attempt == skip.attempt for e in skips.entries):
        return False
    # windows after the new one's checkpoint lie inside it (`data_skip_for`): superseded
    skips.entries = [e for e in skips.entries if e.after_step <= skip.after_step] + [skip]
    write_json_atomic(run.data_skip, skips.model_dump(mode="json"))
    return True
