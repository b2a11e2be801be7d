"""Is there room now for the checkpoint a relaunch will write? Asked after a full disk.

A run stopped by a full disk comes back to the same filesystem: no node to exclude, nothing that
frees space by itself. Relaunched before someone frees it, the job trains up to its next save and
fails there again (or at its first metrics line), and a supervisor relaunching it loops. So the
verdict refuses while the filesystem of the run's checkpoints has less free space than one
checkpoint takes (the newest one on disk, measured; a save is written in full before the
oldest kept one is deleted, ckpt/commit.py), and says how much is missing. A filesystem whose
free space cannot be read (an object store, a remote fsspec filesystem) is not refused: the
reasons say to check it.
"""

from __future__ import annotations

import os
import shutil

from fsspec.implementations.local import LocalFileSystem

from mscale.ckpt.listing import format_bytes
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir


def shortfall(run: RunDir, checkpoint: str | None) -> str | None:
    """Why a relaunch would meet a full disk again (a sentence), or None when there is room or
    it cannot be told. ``checkpoint``: the one the relaunch resumes from, whose size is what
    the next save will write (None: nothing saved yet, so nothing to compare)."""
    if checkpoint is None:
        return None
    fs, path = fs_and_path(checkpoint)
    if not isinstance(fs, LocalFileSystem):
        return None
    try:
        need = fs.du(path)
        at = fs_and_path(run.ckpt)[1]
        while not os.path.exists(at):
            at = os.path.dirname(at) or "/"
        free = shutil.disk_usage(at).free
    except OSError:
        return None
    if free >= need:
        return None
    return (f"the filesystem of {run.ckpt} is still full: {format_bytes(free)} free, one "
            f"checkpoint takes {format_bytes(need)} ({checkpoint}); free at least "
            f"{format_bytes(need - free)} (or keep fewer checkpoints), then run recover again")
