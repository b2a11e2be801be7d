"""Which checkpoint a recovery resumes from: the newest committed one that verifies and precedes
the first bad step.

A checkpoint at step ``s`` holds the state *after* step ``s``; a NaN, divergence or spike episode
whose first bad step is ``b`` was caused by the data or state of step ``b``, so a usable
checkpoint needs ``s < b`` (the state before the bad step, from which step ``b`` can be skipped or
retried). Newer checkpoints are walked newest first, and every one passed over is listed with
why: uncommitted (its write never finished), at or after the bad step, or failed verification
(a corrupted ``latest`` target is passed over with the problem verify found). ``is_latest`` is
True only when ``--resume auto`` would load the choice (`catalog.auto_choice`: what ``latest``
names, or a committed checkpoint newer than it); a broken pointer is listed as ``latest`` in
``rejected`` and the relaunch must name the path. ``rollback`` is True when a committed
checkpoint newer than the choice is passed over: trained steps are lost (the verdict is
degraded). A crash between a commit and its pointer loses nothing. Recover pins the choice when
the relaunch names it (a rollback, or a broken pointer).
``abandoned-…`` directories (moved aside by an earlier rollback) are out of the run's timeline
and never chosen.

Verification is ``quick`` by default (manifest, marker, structure, every shard present with its
recorded size: seconds even for a large model) and ``full`` on request (every chunk's crc32:
reads the whole checkpoint). The load itself checks every chunk it reads, so a bit flip that
``quick`` cannot see still stops the relaunch with a named file instead of a silent resume; the
diagnosis of that failure (symptom ``damaged_checkpoint``) names the checkpoint, and it is passed
over like one that fails verification, whatever ``verify`` says of it: "the relaunch failed
reading it: <what the load said>". So ``quick`` and ``full`` choose alike after such a failure.
A damaged checkpoint the failure names outside this run (a ``--resume`` of another run's) is
nothing to pass over here: `names_damaged` tells the verdict so.
"""

from __future__ import annotations

import os
from typing import get_args

from mscale.ckpt import catalog
from mscale.ckpt.verify import verify as verify_ckpt
from mscale.errors import MscaleError
from mscale.recover.decision import CheckpointChoice, Diagnosis, Verify
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir

VERIFY_MODES = get_args(Verify)
FAILED_READING = "the relaunch failed reading it"
UNCOMMITTED = "uncommitted: its write never finished (no COMMITTED marker)"
"""Why a save that never committed is passed over: nothing it held was ever a checkpoint."""
"""How a checkpoint the last attempt failed reading is passed over (then what the read said)."""


def choose_checkpoint(run: RunDir, diagnosis: Diagnosis,
                      verify: Verify = "quick") -> CheckpointChoice:
    """The checkpoint to resume from (module docstring); ``path`` None when nothing is usable."""
    if verify not in VERIFY_MODES:
        raise MscaleError(f"unknown verify mode {verify!r}", field="verify",
                          fix=f"use one of {', '.join(VERIFY_MODES)}")
    found = catalog.entries(run.ckpt, sizes=False)
    latest, latest_problem = _latest(run)
    bad = diagnosis.bad_step
    damaged = names_damaged(run, diagnosis)
    rejected: list[dict] = []
    if latest_problem:
        rejected.append({"name": catalog.LATEST, "why": latest_problem})
    for e in reversed(found):
        if e.committed and e.name == damaged:  # the load's own words, before verify's
            why = f"{FAILED_READING}: {diagnosis.damaged_error or 'damaged'}"
        else:
            why = _why_not(run, e, bad, verify)
        if why is not None:
            rejected.append({"name": e.name, "why": why})
            continue
        # True only when `--resume auto` would load this very checkpoint (catalog.auto_choice:
        # the pointer's, or a committed one newer than it); a broken pointer means the relaunch
        # must name the path (auto would fail)
        is_latest = latest_problem is None and e.name == catalog.auto_choice(found, latest)
        rollback = any(f.committed and f.step > e.step for f in found)
        return CheckpointChoice(path=catalog.join(run.ckpt, e.name), step=e.step,
                                reason=_reason(e.step, bad, verify, rejected, rollback),
                                rejected=rejected, is_latest=is_latest, rollback=rollback)
    none = "no checkpoint" if not found else f"none of the {len(found)} checkpoint(s)"
    before = f" before step {bad}" if bad is not None else ""
    # whether the run may start over from step 0 is the verdict's call (decide.py), not said here
    return CheckpointChoice(path=None, step=None, reason=f"{none} is usable{before}",
                            rejected=rejected, is_latest=False, rollback=False)


def names_damaged(run: RunDir, diagnosis: Diagnosis) -> str | None:
    """The name (``step-NNNNNN``) of this run's checkpoint that the diagnosis says the last
    attempt failed reading, or None: no such failure, or a checkpoint of another directory."""
    path = diagnosis.damaged_checkpoint
    if not path:
        return None
    name = catalog.basename(path)
    return name if _same_dir(catalog.parent(path), run.ckpt, run.root) else None


def _same_dir(named: str, ckpt: str, root: str) -> bool:
    """Whether ``named`` (the parent of a checkpoint a failure named) is the run's ``ckpt``
    directory. Local paths are compared resolved; when the named one does not exist on this
    machine (the run directory was moved, or is mounted elsewhere here), its last two parts
    ``RUN/ckpt`` are compared with the run's."""
    if "://" in named or "://" in ckpt:  # a URL: as train spelt it, from the same --run-dir
        return named.rstrip("/") == ckpt.rstrip("/")
    if os.path.realpath(named) == os.path.realpath(ckpt):
        return True
    if os.path.isdir(named):
        return False
    return (catalog.basename(named) == catalog.basename(ckpt)
            and catalog.basename(catalog.parent(named)) == catalog.basename(os.path.abspath(root)))


def _latest(run: RunDir) -> tuple[str | None, str | None]:
    """What ``latest`` names, and what is wrong with the pointer itself (None when fine)."""
    try:
        name = catalog.read_latest(run.ckpt)
    except MscaleError as e:
        return None, f"unreadable pointer: {e.message}"
    if name is None:
        return None, None
    fs, path = fs_and_path(catalog.join(run.ckpt, name))
    if not fs.isdir(path):
        return name, f"names {name}, which does not exist"
    return name, None


def _why_not(run: RunDir, e: catalog.Entry, bad: int | None, verify: str) -> str | None:
    """Why checkpoint ``e`` cannot be resumed from, or None when it can."""
    if not e.committed:
        return UNCOMMITTED
    if bad is not None and e.step >= bad:
        return (f"holds the state after step {e.step}, not before the first bad step {bad}")
    try:
        rep = verify_ckpt(catalog.join(run.ckpt, e.name), quick=verify == "quick")
    except MscaleError as e2:
        return f"failed {verify} verify: {e2.message}"
    if not rep.ok:
        p = rep.problems[0]
        more = f" (and {len(rep.problems) - 1} more)" if len(rep.problems) > 1 else ""
        where = f"{p.file}{': ' + p.field if p.field else ''}"
        return f"failed {verify} verify: {where}: {p.message}{more}"
    if rep.step != e.step:
        return f"its manifest says step {rep.step}, its name step {e.step}"
    return None


def _reason(step: int, bad: int | None, verify: str, rejected: list[dict],
            rollback: bool) -> str:
    """One sentence: why this checkpoint."""
    what = "the newest usable checkpoint" if rollback else "the latest checkpoint"
    head = f"step {step}: {what}, committed and passing {verify} verify"
    if bad is not None:
        head += f", before the first bad step {bad}"
    skipped = [r["name"] for r in rejected if r["name"] != catalog.LATEST]
    if skipped:
        head += f"; passed over {len(skipped)} newer ({', '.join(skipped[:3])}"
        head += ", ...)" if len(skipped) > 3 else ")"
    return head
