"""Which checkpoint a starting run continues from, and tidying the run's ckpt/ before it does.

Decided on rank 0 only (one rank reads the directory, not 12,288) and broadcast.

- ``auto``: what ``RUN/ckpt/latest`` names; without a ``latest``, or with a committed checkpoint
  newer than it (a crash between a commit and its pointer, a pointer deleted by hand), the
  newest committed checkpoint, with a note; a fresh run when there is none.
- ``none``: a fresh run; refused when the run already has committed checkpoints (they would be
  mixed with the new run's).
- a path: that checkpoint (or run directory's latest), e.g. an HF import or a rollback. A path
  outside this run's ``ckpt/`` starts the run only: once the run has a committed checkpoint of
  its own, its ``latest`` is resumed instead, with a note (as torchtitan's initial load path).
  The same command run again after a halt or a crash ("the same command resumes") would
  otherwise roll the run back to the foreign checkpoint and move its newer ones aside.

Before training starts, directories without a commit marker are removed (dead attempts: nothing
is writing at start-up), and committed checkpoints *newer* than the resume point are moved aside
to ``abandoned-step-NNNNNN-<time>`` (a rollback must not be overwritten step by step, nor
deleted silently). Both are listed in the resume event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mscale.ckpt import catalog
from mscale.ckpt.manifest import Manifest
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import fs_and_path


@dataclass
class ResumePoint:
    path: str
    manifest: Manifest
    cleaned: list[str]

    def to_json(self) -> dict:
        return {"path": self.path, "manifest": self.manifest.model_dump(mode="json"),
                "cleaned": self.cleaned}

    @classmethod
    def from_json(cls, data: dict) -> "ResumePoint":
        return cls(data["path"], Manifest.model_validate(data["manifest"]), data["cleaned"])


def choose_resume(root: str, mode: str) -> ResumePoint | None:
    """Rank 0: the checkpoint to load (None: start fresh) after tidying ``root`` (RUN/ckpt)."""
    found = catalog.entries(root, sizes=False)
    target = _target(root, mode, found)
    manifest = catalog.load_named(target) if target else None
    step = manifest.state.step if manifest else 0
    cleaned = tidy(root, found, step, keep=catalog.basename(target) if target else None)
    if manifest is None:
        return None
    if any(c.startswith("moved ") for c in cleaned) and catalog.in_run(target, root):
        # a rollback: `latest` named a checkpoint now moved aside; a crash before the next
        # commit would have found it naming nothing (exit 3 on every resume)
        catalog.write_latest(root, catalog.basename(target))
    pointer = catalog.read_latest(root) if mode == "auto" else None
    if mode == "auto" and pointer != catalog.basename(target):
        said = "is missing" if pointer is None else f"names {pointer}, an older one"
        cleaned.insert(0, f"note: {catalog.join(root, catalog.LATEST)} {said} (a crash between "
                          f"a commit and its pointer); continuing from the newest committed "
                          f"checkpoint, {catalog.basename(target)}")
    foreign = mode not in ("auto", "none") and not catalog.in_run(catalog.resolve(mode), root)
    if foreign and catalog.in_run(target, root):
        cleaned.insert(0, f"note: --resume {mode} only starts a run; this run has checkpoints "
                          f"of its own, so it continues from its latest, "
                          f"{catalog.basename(target)} (to roll back on purpose: --resume "
                          f"{catalog.join(root, '<step-N>')})")
    return ResumePoint(target, manifest, cleaned)


def check_resume(root: str, mode: str) -> Manifest | None:
    """What `choose_resume` would load, checked without changing anything: for a launcher to
    refuse a bad ``--resume`` or ``latest`` (naming the file) before any worker starts."""
    point = check_resume_point(root, mode)
    return point.manifest if point else None


def check_resume_point(root: str, mode: str) -> ResumePoint | None:
    """`check_resume` with the checkpoint's path: whether it is the run's own decides what a
    change of data means (train/resumed.py). Nothing tidied, so nothing in ``cleaned``."""
    target = _target(root, mode, catalog.entries(root, sizes=False))
    return ResumePoint(target, catalog.load_named(target), []) if target else None


def _target(root: str, mode: str, found: list[catalog.Entry]) -> str | None:
    if mode == "none":
        committed = [e.name for e in found if e.committed]
        if committed:
            which = (f"a committed checkpoint ({committed[0]})" if len(committed) == 1 else
                     f"{len(committed)} committed checkpoints (the newest {committed[-1]})")
            raise MscaleError(f"the run already has {which}", file=root, field="--resume",
                              fix="continue it with --resume auto, or use a new --run-dir")
        return None
    if mode == "auto":
        return _newest(root, found)
    try:
        target = catalog.resolve(mode)
    except MscaleError as e:  # the path came from --resume: the error names the option
        e.field = e.field or "--resume"
        raise
    committed = [e for e in found if e.committed]
    if committed and not catalog.in_run(target, root):  # a foreign path starts a run
        # then the run continues from what auto loads (its latest, or a committed checkpoint
        # newer than it): never the foreign one, nor an older one, which would move the newer
        # ones aside
        return _newest(root, found)
    return target


def _newest(root: str, found: list[catalog.Entry]) -> str | None:
    """``auto``: what ``latest`` names, unless a committed checkpoint is newer (a crash between
    its ``COMMITTED`` and the pointer, or no pointer at all): that one, complete and checked by
    its marker, rather than resuming an interval back and moving it aside, or a fresh run that
    would move them all aside and train from step 0 again (`catalog.auto_choice`)."""
    latest = _latest_target(root)
    name = catalog.auto_choice(found, catalog.basename(latest) if latest else None)
    return None if name is None else catalog.join(root, name)


def _latest_target(root: str) -> str | None:
    """The checkpoint ``latest`` names, checked to exist: a bad pointer is reported as the
    pointer's fault (naming ``latest``), not as a missing manifest or shard of what it names."""
    name = catalog.read_latest(root)  # an MscaleError naming latest when it is not a step name
    if name is None:
        return None
    return catalog.pointed_target(
        catalog.join(root, catalog.LATEST), name, EXIT_BAD_INPUT,
        "rewrite it with the newest committed checkpoint (mscale ckpt ls lists them), or pass "
        "--resume RUN_DIR/ckpt/step-NNNNNN")


def tidy(root: str, found: list[catalog.Entry], step: int, keep: str | None) -> list[str]:
    """Remove uncommitted attempts; move committed checkpoints newer than ``step`` aside."""
    out = []
    fs, base = fs_and_path(root)
    for e in found:
        if e.name == keep:
            continue
        if not e.committed:
            catalog.remove(catalog.join(root, e.name))
            out.append(f"removed {e.name} (never committed)")
        elif e.step > step:
            aside = f"abandoned-{e.name}-{int(time.time())}"
            fs.mv(f"{base}/{e.name}", f"{base}/{aside}", recursive=True)
            out.append(f"moved {e.name} to {aside} (newer than the resume point)")
    return out
