"""Is there room now for the checkpoints a relaunch will write? Asked after a full disk.

A run stopped by a full disk comes back to the same filesystem: no node to exclude, nothing that
frees space by itself. Relaunched before someone frees it, the job trains up to its next save and
fails there again (or at its first metrics line), and a supervisor relaunching it loops. So the
verdict refuses while the filesystem of the run's checkpoints has less free space than the
saves the relaunch writes before retention deletes one (`saves_before_a_deletion`; each the
size of the checkpoint it resumes from, measured), and says how much is missing. A filesystem
whose free space cannot be read (an object store, a remote fsspec filesystem) is not refused:
the reasons say to check it.
"""

from __future__ import annotations

import os
import shutil

from fsspec.implementations.local import LocalFileSystem

from mscale.ckpt import catalog, pins
from mscale.ckpt.listing import format_bytes
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir


def saves_before_a_deletion(run: RunDir, checkpoint: str, keep: int, pinned: bool) -> int:
    """How many checkpoints the relaunch writes before retention deletes one (ckpt/commit.py
    `retain`: a save is written in full before the oldest kept one is deleted, and only once
    more than ``keep`` count): one when the run already holds ``keep`` of them, more when it
    holds fewer, e.g. after an operator deleted old ones to make room. Counted are the committed
    checkpoints up to the resume point (newer ones are moved aside) that retention may delete;
    pinned ones and those an open episode protects do not count, nor the resume point when
    recover pins it (``pinned``: a rollback)."""
    found = catalog.entries(run.ckpt, sizes=False)
    step = next((e.step for e in found if e.name == catalog.basename(checkpoint)), None)
    guarded = set(pins.protected(run.ckpt, found))
    if pinned:
        guarded.add(catalog.basename(checkpoint))
    counted = [e for e in found if e.committed and e.name not in guarded
               and (step is None or e.step <= step)]
    return max(1, keep + 1 - len(counted))


def shortfall(run: RunDir, checkpoint: str | None, keep: int,
              pinned: bool = False) -> str | None:
    """Why a relaunch would meet a full disk again (a sentence), or None when there is room or
    it cannot be told. ``checkpoint``: the one the relaunch resumes from, whose size is what
    each save will write (None: nothing saved yet, so nothing to compare); ``keep``: the
    relaunch's ``--ckpt-keep``; ``pinned``: recover pins ``checkpoint`` (a rollback)."""
    if checkpoint is None:
        return None
    fs, path = fs_and_path(checkpoint)
    if not isinstance(fs, LocalFileSystem):
        return None
    try:
        size = fs.du(path)
        at = fs_and_path(run.ckpt)[1]
        while not os.path.exists(at):
            at = os.path.dirname(at) or "/"
        free = shutil.disk_usage(at).free
        saves = saves_before_a_deletion(run, checkpoint, keep, pinned)
    except OSError:
        return None
    need = saves * size
    if free >= need:
        return None
    what = (f"one checkpoint takes {format_bytes(size)} ({checkpoint})" if saves == 1 else
            f"the relaunch writes {saves} checkpoints of {format_bytes(size)} ({checkpoint}) "
            f"before retention (--ckpt-keep {keep}) deletes one")
    return (f"the filesystem of {run.ckpt} is still full: {format_bytes(free)} free, {what}; "
            f"free at least {format_bytes(need - free)} (or keep fewer checkpoints: a smaller "
            "--ckpt-keep in the job's command), then run recover again")
