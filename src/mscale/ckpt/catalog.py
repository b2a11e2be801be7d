"""The checkpoints of a run directory: names, the `latest` pointer, status, retention.

``RUN/ckpt/step-000120/`` is one checkpoint; it counts only once its ``COMMITTED`` marker exists.
``RUN/ckpt/latest`` is a small text file naming the newest committed checkpoint's directory,
replaced atomically after each commit (a file, not a symlink, so object stores work too).
Everything goes through fsspec: a run directory may be a local path or any URL.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.ckpt.manifest import (COMMITTED, MANIFEST, CommitMarker, Manifest, check_relative,
                                  parse_manifest, parse_marker, sha256)
from mscale.errors import EXIT_CRITICAL, MscaleError
from mscale.runs.atomic import fs_and_path, write_text_atomic

LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(step: int) -> str:
    return f"step-{step:06d}"


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def read_bytes(url: str) -> bytes | None:
    """A small file's bytes, or None when it does not exist."""
    fs, path = fs_and_path(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def resolve(path: str) -> str:
    """A checkpoint directory from what a user may pass: the directory itself, a ``latest``
    pointer file, a run's ``ckpt`` directory, or a run directory (its latest checkpoint)."""
    fs, p = fs_and_path(path)
    if fs.isfile(p):
        name = (read_bytes(path) or b"").decode().strip()
        try:
            check_relative(name)
        except ValueError:
            raise MscaleError(f"pointer names {name!r}, not a checkpoint directory", file=path,
                              fix="rewrite it with the name of a step-NNNNNN directory")
        return join(parent(path), name)
    if not fs.isdir(p):
        raise MscaleError("no such checkpoint or run directory", file=path,
                          fix="pass RUN_DIR, RUN_DIR/ckpt/latest or RUN_DIR/ckpt/step-NNNNNN")
    if fs.exists(join(p, MANIFEST)) or STEP_DIR.match(basename(p)):
        return path
    for root in (join(path, "ckpt"), path):
        if fs.isfile(fs_and_path(join(root, LATEST))[1]):
            return resolve(join(root, LATEST))
    raise MscaleError("no checkpoint here (no manifest.json, no ckpt/latest)", file=path,
                      fix="pass a step-NNNNNN checkpoint directory or a run directory that has one")


def open_inside(ckpt: str, name: str, mode: str = "rb"):
    """Open a file named by a manifest, refusing one that escapes the checkpoint directory (the
    name is checked by `check_relative`; locally, a symlink pointing outside is refused too)."""
    check_relative(name)
    fs, root = fs_and_path(ckpt)
    path = join(root, name)
    if is_local(fs):
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if os.path.dirname(real) != real_root:
            raise MscaleError(f"{name} resolves to {real}, outside the checkpoint directory",
                              file=join(ckpt, name), field="shards.path", code=EXIT_CRITICAL,
                              fix="replace the symlink with the shard file itself")
        return open(path, mode)
    return fs.open(path, mode)


def load_manifest(ckpt: str) -> Manifest:
    data = read_bytes(join(ckpt, MANIFEST))
    if data is None:
        raise MscaleError("manifest.json is missing", file=ckpt, code=EXIT_CRITICAL,
                          fix="the checkpoint was never completed; use an older one (mscale ckpt ls)")
    return parse_manifest(data, join(ckpt, MANIFEST))


def load_marker(ckpt: str) -> CommitMarker | None:
    data = read_bytes(join(ckpt, COMMITTED))
    return None if data is None else parse_marker(data, join(ckpt, COMMITTED))


def load_committed(ckpt: str) -> Manifest:
    """The manifest of a committed checkpoint; refuses an uncommitted or altered one (exit 2)."""
    raw = read_bytes(join(ckpt, MANIFEST))
    marker = load_marker(ckpt)
    if marker is None:
        raise MscaleError("not committed (no COMMITTED marker): its write never finished",
                          file=ckpt, code=EXIT_CRITICAL,
                          fix="use the run's ckpt/latest or an older committed checkpoint")
    if raw is None or sha256(raw) != marker.manifest_sha256:
        raise MscaleError("manifest.json does not match the commit marker's sha256",
                          file=join(ckpt, MANIFEST), code=EXIT_CRITICAL,
                          fix="the checkpoint was altered after its commit; use an older one")
    return parse_manifest(raw, join(ckpt, MANIFEST))


@dataclass
class Entry:
    """One checkpoint directory of a run, as `ls` shows it."""

    name: str
    step: int
    committed: bool
    bytes: int
    layout: dict | None


def entries(ckpt_root: str, sizes: bool = True) -> list[Entry]:
    """The step-NNNNNN directories under a run's ckpt/, oldest first."""
    fs, root = fs_and_path(ckpt_root)
    if not fs.isdir(root):
        return []
    out = []
    for info in fs.ls(root, detail=True):
        name = basename(info["name"])
        m = STEP_DIR.match(name)
        if not m or info.get("type") != "directory":
            continue
        path = join(ckpt_root, name)
        committed = fs.exists(join(root, name, COMMITTED))
        size = sum(f.get("size") or 0 for f in fs.ls(join(root, name), detail=True)) if sizes else 0
        layout = None
        if committed:
            try:
                layout = load_manifest(path).layout
            except MscaleError:
                layout = None
        out.append(Entry(name, int(m.group(1)), committed, size, layout))
    return sorted(out, key=lambda e: e.step)


def read_latest(ckpt_root: str) -> str | None:
    """The directory name ``latest`` points to, or None."""
    data = read_bytes(join(ckpt_root, LATEST))
    if data is None:
        return None
    name = data.decode().strip()
    check_relative(name)
    return name


def write_latest(ckpt_root: str, name: str) -> None:
    write_text_atomic(join(ckpt_root, LATEST), name + "\n")


def remove(path: str) -> None:
    fs, p = fs_and_path(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def retain(ckpt_root: str, keep: int, newest: str) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep`` and uncommitted ones older than
    ``newest`` (dead attempts). Never deletes ``newest`` or what ``latest`` names. Returns the
    names removed."""
    keep = max(1, keep)
    all_entries = entries(ckpt_root, sizes=False)
    protected = {newest, read_latest(ckpt_root)}
    newest_step = next((e.step for e in all_entries if e.name == newest), None)
    committed = [e for e in all_entries if e.committed]
    doomed = [e for e in committed[:-keep]] if len(committed) > keep else []
    if newest_step is not None:
        doomed += [e for e in all_entries if not e.committed and e.step < newest_step]
    removed = []
    for e in doomed:
        if e.name not in protected:
            remove(join(ckpt_root, e.name))
            removed.append(e.name)
    return removed
