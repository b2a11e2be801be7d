"""The checkpoints of a run directory: names, the `latest` pointer, status (retention:
commit.retain). Opening the files one holds is files.py.

``RUN/ckpt/step-000120/`` is one checkpoint; it counts only once its ``COMMITTED`` marker exists.
``RUN/ckpt/latest`` is a small text file naming the newest committed checkpoint's directory,
replaced atomically after each commit (a file, not a symlink, so object stores work too).
Everything goes through fsspec: a run directory may be a local path or any URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mscale.ckpt import untrusted
from mscale.ckpt.checks import parse_manifest
from mscale.ckpt.files import is_local, join, read_bytes
from mscale.ckpt.limits import MAX_MANIFEST_BYTES
from mscale.ckpt.manifest import (COMMITTED, MANIFEST, CommitMarker, Manifest, parse_marker,
                                  sha256)
from mscale.errors import EXIT_CRITICAL, MscaleError
from mscale.runs.atomic import fs_and_path, write_text_atomic
from mscale.urls import location_key

LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(step: int) -> str:
    return f"step-{step:06d}"


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."


def in_run(checkpoint: str, ckpt_root: str) -> bool:
    """Whether ``checkpoint`` lies in a run's own ``ckpt/`` directory ``ckpt_root``, however
    either is spelled: local paths resolved (``file://``, relative, ``..``, a symlinked run
    directory), URLs as written but for a trailing slash. The one rule for "the run's own"
    (a resume that only starts a run, train's notes on a restart, recover's relaunch)."""
    return location_key(checkpoint).startswith(location_key(ckpt_root).rstrip("/") + "/")


def _not_a_link(url: str) -> None:
    """A ``latest`` made by hand as a symbolic link (``ln -s step-000020 latest``) is no
    damaged checkpoint: say what it is and how to write the pointer (it read as "the checkpoint
    was altered; move it away", exit 2)."""
    fs, path = fs_and_path(url)
    if is_local(fs) and os.path.islink(path):
        target = os.readlink(path)
        name = os.path.basename(target.rstrip("/"))
        example = name if STEP_DIR.match(name) else "step-NNNNNN"
        raise MscaleError(f"is a symbolic link (to {target}), not the pointer file mscale writes",
                          file=url, fix=f"replace it with a text file naming the checkpoint: rm "
                          f"{path} && echo {example} > {path}")


def read_pointer(url: str) -> str:
    """The step-NNNNNN name held by a pointer file such as ``latest`` (an error names the file:
    binary, another encoding, a path, anything but a checkpoint directory's name)."""
    _not_a_link(url)
    data = read_bytes(url)
    if data is None:
        raise MscaleError("no such file", file=url, fix="pass RUN_DIR or RUN_DIR/ckpt/step-NNNNNN")
    return _pointer_name(data, url)


_REWRITE = ("rewrite it with the name of a committed step-NNNNNN directory beside it "
            "(mscale ckpt ls lists them)")


def _pointer_name(data: bytes, url: str) -> str:
    name = untrusted.text(data, url, "pointer", fix=_REWRITE).strip()
    if not STEP_DIR.match(name) or len(name) > 64:
        raise MscaleError(f"names {name[:80]!r}, not a checkpoint directory (step-NNNNNN)",
                          file=url, code=EXIT_CRITICAL, fix=_REWRITE)
    return name


def resolve(path: str) -> str:
    """A checkpoint directory from what a user may pass: the directory itself (or its
    manifest.json), a ``latest`` pointer file (what it names), a run's ``ckpt`` directory, or a
    run directory (for these two, what ``--resume auto`` would load: `auto_choice`). Any other
    file is bad input, not a damaged pointer: only a file called ``latest`` is read as one."""
    fs, p = fs_and_path(path)
    if fs.exists(p) and not fs.isdir(p):
        if basename(p) == MANIFEST:
            return parent(path)
        if basename(p) != LATEST:
            raise MscaleError("is a file, not a checkpoint", file=path,
                              fix="pass RUN_DIR, RUN_DIR/ckpt/latest or RUN_DIR/ckpt/step-NNNNNN")
        return _pointed(path)  # refuses FIFOs and the like
    if not fs.isdir(p):
        raise MscaleError("no such checkpoint or run directory", file=path,
                          fix="pass RUN_DIR, RUN_DIR/ckpt/latest or RUN_DIR/ckpt/step-NNNNNN")
    if fs.exists(join(p, MANIFEST)) or fs.exists(join(p, COMMITTED)) \
            or STEP_DIR.match(basename(p)):  # a commit marker alone: a damaged checkpoint
        return path
    for root in (join(path, "ckpt"), path):
        chosen = _auto_target(root)
        if chosen:
            return chosen
    if fs.exists(join(p, "config.json")):  # a HuggingFace model folder
        raise MscaleError("a HuggingFace model folder, not an mscale checkpoint", file=path,
                          fix=f"convert it first: mscale ckpt convert {path} DST --plan PLAN, "
                              "then resume from DST (docs/ckpt.md)")
    raise MscaleError("no checkpoint here (no manifest.json, no ckpt/latest, no committed "
                      "ckpt/step-NNNNNN)", file=path,
                      fix="pass a step-NNNNNN checkpoint directory or a run directory with one")


def _auto_target(root: str) -> str | None:
    """What ``--resume auto`` would load from the checkpoints under ``root`` (`auto_choice`), or
    None when ``root`` holds neither a ``latest`` nor a committed checkpoint. A ``latest`` that
    names nothing is an error, as it is for train."""
    fs, p = fs_and_path(join(root, LATEST))
    latest = _pointed(join(root, LATEST)) if fs.exists(p) else None
    name = auto_choice(entries(root, sizes=False), basename(latest) if latest else None)
    return join(root, name) if name else None


def _pointed(latest: str) -> str:
    """The checkpoint a ``latest`` file names, which must exist (`pointed_target`)."""
    return pointed_target(latest, read_pointer(latest), EXIT_CRITICAL,
                          "pass one that exists (mscale ckpt ls lists them), or rewrite latest "
                          "to name it")


def pointed_target(latest: str, name: str, code: int, fix: str) -> str:
    """The checkpoint ``name`` that the pointer file ``latest`` holds, checked to exist: a
    pointer to a step that is not there is the pointer's fault (``latest`` named, exit ``code``),
    not a checkpoint "never completed" or a missing manifest."""
    target = join(parent(latest), name)
    fs, p = fs_and_path(target)
    if not fs.isdir(p):
        raise MscaleError(f"names {name}, which does not exist", file=latest, code=code,
                          fix=fix)
    return target


def load_manifest(ckpt: str) -> Manifest:
    data = read_bytes(join(ckpt, MANIFEST), MAX_MANIFEST_BYTES)
    if data is None:
        raise MscaleError("manifest.json is missing", file=ckpt, code=EXIT_CRITICAL,
                          fix="the checkpoint was never completed; use an older one "
                              "(mscale ckpt ls)")
    return parse_manifest(data, join(ckpt, MANIFEST))


def load_marker(ckpt: str) -> CommitMarker | None:
    data = read_bytes(join(ckpt, COMMITTED))
    return None if data is None else parse_marker(data, join(ckpt, COMMITTED))


def misnamed(ckpt: str, step: int) -> int | None:
    """The step a ``step-NNNNNN`` directory's name says, when the checkpoint in it is at
    another ``step``; None otherwise (or for another name). `ls`, retention, ``latest`` and
    ``--resume auto`` go by the name, a resume by the manifest: a step-4 checkpoint copied to
    step-000008 was taken for the newest (a resume rolled the run back to step 4, moving the
    real newer checkpoints aside; a convert exported step 4)."""
    m = STEP_DIR.match(basename(ckpt))
    return int(m.group(1)) if m and int(m.group(1)) != step else None


def load_named(ckpt: str) -> Manifest:
    """`load_committed`, refusing (exit 3, naming it) a directory named for another step
    (`misnamed`): what a resume or a convert of a run picks by its name must hold that step."""
    manifest = load_committed(ckpt)
    said = misnamed(ckpt, manifest.step)
    if said is not None:
        raise MscaleError(f"holds step {manifest.step}, but its name says step {said}",
                          file=ckpt, field="step",
                          fix=f"rename it {step_dir(manifest.step)} (or move it out of the "
                              "run); mscale ckpt ls lists the run's checkpoints")
    return manifest


def load_committed(ckpt: str) -> Manifest:
    """The manifest of a committed checkpoint; refuses an uncommitted or altered one (exit 2)."""
    raw = read_bytes(join(ckpt, MANIFEST), MAX_MANIFEST_BYTES)
    marker = load_marker(ckpt)
    if marker is None:
        raise MscaleError("not committed (no COMMITTED marker): its write never finished",
                          file=ckpt, code=EXIT_CRITICAL,
                          fix="resume from a committed checkpoint: `mscale ckpt ls RUN_DIR` "
                              "lists them; --resume RUN_DIR/ckpt/step-NNNNNN (when ckpt/latest "
                              "names this one, it is damaged too)")
    if raw is None:
        raise MscaleError("manifest.json is missing, though the COMMITTED marker says the "
                          "checkpoint was completed: it was removed after the commit",
                          file=join(ckpt, MANIFEST), code=EXIT_CRITICAL,
                          fix="the checkpoint is damaged; use an older one (mscale ckpt ls)")
    if sha256(raw) != marker.manifest_sha256:
        raise MscaleError("manifest.json does not match the commit marker's sha256",
                          file=join(ckpt, MANIFEST), code=EXIT_CRITICAL,
                          fix="the checkpoint was altered after its commit; use an older one")
    manifest = parse_manifest(raw, join(ckpt, MANIFEST))
    if manifest.step != marker.step:
        raise MscaleError(f"the commit marker says step {marker.step}, the manifest "
                          f"{manifest.step}", file=join(ckpt, COMMITTED), field="step",
                          code=EXIT_CRITICAL, fix=untrusted.DAMAGED)
    return manifest


@dataclass
class Entry:
    """One checkpoint directory of a run, as `ls` shows it."""

    name: str
    step: int | None
    """The step its name says (a directory not named step-NNNNNN: its manifest's, None when
    that cannot be read)."""
    committed: bool
    bytes: int
    layout: dict | None
    manifest_step: int | None = None
    """The step its manifest says (None when not read or unreadable)."""
    problem: str | None = None
    """Why its manifest could not be read, for `ls`."""


def entries(ckpt_root: str, sizes: bool = True) -> list[Entry]:
    """The step-NNNNNN directories under a run's ckpt/, oldest first. With ``sizes`` (``ls``),
    also their sizes and what their manifests say (`entry`); retention and resume need only
    the names."""
    fs, root = fs_and_path(ckpt_root)
    if not fs.isdir(root):
        return []
    out = []
    for info in fs.ls(root, detail=True):
        name = basename(info["name"])
        m = STEP_DIR.match(name)
        if not m or info.get("type") != "directory":
            continue
        try:
            out.append(entry(ckpt_root, name, sizes))
        except FileNotFoundError:  # removed since the listing (a failed save cleaned up)
            continue
    return sorted(out, key=lambda e: e.step)


def entry(ckpt_root: str, name: str, sizes: bool = True) -> Entry:
    """One checkpoint directory ``name`` under ``ckpt_root``; its step is its name's (for a
    directory not named step-NNNNNN, its manifest's). With ``sizes``, its size on disk
    (`dir_bytes`) and, when committed, its layout from its checked manifest."""
    ckpt = join(ckpt_root, name)
    m = STEP_DIR.match(name)
    fs, marker = fs_and_path(join(ckpt, COMMITTED))
    committed = fs.exists(marker)
    out = Entry(name, int(m.group(1)) if m else None, committed, 0, None)
    if sizes:
        out.bytes = dir_bytes(ckpt)
    if sizes and committed:
        try:  # checked against its marker, as a resume checks it: an edited one is refused
            manifest = load_committed(ckpt)
            out.layout, out.manifest_step = manifest.layout, manifest.step
        except MscaleError as e:
            out.problem = f"{e.field + ': ' if e.field else ''}{e.message}"
    if out.step is None:
        out.step = out.manifest_step
    return out


def dir_bytes(ckpt: str) -> int:
    """A checkpoint's size on disk: every file in its directory (shards, their index files,
    the manifest, the commit marker, a pin). The one size `ls` and `verify` print, so that the
    two agree on the same checkpoint. FileNotFoundError when the directory is gone."""
    fs, path = fs_and_path(ckpt)
    return sum(f.get("size") or 0 for f in fs.ls(path, detail=True)
               if f.get("type") != "directory")


def read_latest(ckpt_root: str) -> str | None:
    """The directory name ``latest`` points to, or None when there is no ``latest``; an
    MscaleError naming the file when it holds anything but a step-NNNNNN name."""
    url = join(ckpt_root, LATEST)
    _not_a_link(url)
    data = read_bytes(url)
    return None if data is None else _pointer_name(data, url)


def auto_choice(found: list[Entry], latest: str | None) -> str | None:
    """The checkpoint ``--resume auto`` continues from (its name), given the run's `entries` and
    the name its ``latest`` holds: the pointer's, unless a committed checkpoint is newer than
    it, or there is no pointer (a crash between a commit and its pointer, a pointer deleted by
    hand): then the newest committed one. None: no pointer and nothing committed. The one rule
    for train's resume, `resolve` (ls, verify, convert of a run) and recover's choice, so that
    the checkpoint an operator verifies or exports is the one a relaunch loads."""
    committed = [e for e in found if e.committed]
    if not committed:
        return latest
    named = next((e for e in committed if e.name == latest), None) if latest else None
    if latest is None or (named is not None and committed[-1].step > named.step):
        return committed[-1].name
    return latest


def advance_latest(ckpt_root: str, name: str) -> str | None:
    """Point ``latest`` at ``name`` unless it names a newer step (an offline conversion into a
    run must not roll the run back). Returns the name ``latest`` keeps, or None when moved. An
    unreadable ``latest`` is replaced."""
    try:
        current = read_latest(ckpt_root)
    except MscaleError:
        current = None
    if current and int(STEP_DIR.match(current).group(1)) > int(STEP_DIR.match(name).group(1)):
        return current
    write_latest(ckpt_root, name)
    return None


def write_latest(ckpt_root: str, name: str) -> None:
    write_text_atomic(join(ckpt_root, LATEST), name + "\n")


def remove(path: str) -> None:
    """Delete a checkpoint directory, its ``COMMITTED`` marker first: a crash (or an error) half
    way through leaves an uncommitted attempt, which every reader ignores and retention clears,
    never a committed checkpoint missing shards."""
    fs, p = fs_and_path(path)
    if not fs.exists(p):
        return
    marker = f"{p.rstrip('/')}/{COMMITTED}"
    if fs.exists(marker):
        fs.rm(marker)
    fs.rm(p, recursive=True)
