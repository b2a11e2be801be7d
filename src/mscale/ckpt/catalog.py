"""The checkpoints of a run directory: names, the `latest` pointer, status (retention: commit.retain).

``RUN/ckpt/step-000120/`` is one checkpoint; it counts only once its ``COMMITTED`` marker exists.
``RUN/ckpt/latest`` is a small text file naming the newest committed checkpoint's directory,
replaced atomically after each commit (a file, not a symlink, so object stores work too).
Everything goes through fsspec: a run directory may be a local path or any URL.
"""

from __future__ import annotations

import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.ckpt import untrusted
from mscale.ckpt.limits import MAX_MANIFEST_BYTES, MAX_SMALL_BYTES
from mscale.ckpt.checks import parse_index, parse_manifest
from mscale.ckpt.manifest import (COMMITTED, MANIFEST, CommitMarker, Manifest, ShardInfo,
                                  SliceInfo, check_relative, parse_marker, sha256)
from mscale.errors import EXIT_CRITICAL, MscaleError
from mscale.runs.atomic import fs_and_path, write_text_atomic
from mscale.urls import location_key

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


def in_run(checkpoint: str, ckpt_root: str) -> bool:
    """Whether ``checkpoint`` lies in a run's own ``ckpt/`` directory ``ckpt_root``, however
    either is spelled: local paths resolved (``file://``, relative, ``..``, a symlinked run
    directory), URLs as written but for a trailing slash. The one rule for "the run's own"
    (a resume that only starts a run, train's notes on a restart, recover's relaunch)."""
    return location_key(checkpoint).startswith(location_key(ckpt_root).rstrip("/") + "/")


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _not_regular(url: str, kind: str) -> MscaleError:
    return MscaleError(f"is {kind}, not a regular file", file=url, code=EXIT_CRITICAL,
                       fix="the checkpoint was altered; move it away and use an older one")


def _open_regular(url: str) -> tuple[object, int]:
    """Open a file for reading and return (handle, size), refusing anything but a regular file
    *before* reading: opening a FIFO blocks until a writer appears, and a directory or a device
    is never a checkpoint file. Locally the file is opened non-blocking and checked with fstat
    on the open descriptor, so nothing can be swapped in between the check and the read."""
    fs, path = fs_and_path(url)
    if is_local(fs):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise _not_regular(url, _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file"))
        return os.fdopen(fd, "rb"), st.st_size
    info = fs.info(path)
    if info.get("type") != "file":
        raise _not_regular(url, f"a {info.get('type', 'thing')}")
    return fs.open(path, "rb"), int(info.get("size") or 0)


def read_bytes(url: str, limit: int = MAX_SMALL_BYTES) -> bytes | None:
    """A small file's bytes, or None when it does not exist. A file that is not a regular file or
    is larger than ``limit`` is refused before it is read (exit 2, naming it)."""
    try:
        fh, size = _open_regular(url)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as e:
        raise MscaleError(f"cannot read it: {e.strerror}", file=url, fix="fix its permissions")
    with fh:
        if size > limit:
            raise MscaleError(f"is {size} bytes, more than the {limit} it may have", file=url,
                              code=EXIT_CRITICAL, fix=untrusted.DAMAGED)
        return fh.read(limit + 1)


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


def open_inside(ckpt: str, name: str):
    """Open a file named by a manifest for reading, refusing one that escapes the checkpoint
    directory (the name is checked by `check_relative`; locally, a symlink pointing outside is
    refused too) or that is not a regular file. Returns (handle, size)."""
    check_relative(name)
    fs, root = fs_and_path(ckpt)
    url = join(ckpt, name)
    if is_local(fs):
        real_root = os.path.realpath(root)
        real = os.path.realpath(join(root, name))
        if os.path.dirname(real) != real_root:
            raise MscaleError(f"resolves to {real}, outside the checkpoint directory", file=url,
                              field="shards.path", code=EXIT_CRITICAL,
                              fix="replace the symlink with the shard file itself")
    return _open_regular(url)


def open_shard(ckpt: str, shard: ShardInfo):
    """A shard file opened for reading, after checking it has the size the manifest records:
    the manifest's slices all lie inside that size (checks.py), so no read can go past the end."""
    try:
        fh, size = open_inside(ckpt, shard.path)
    except FileNotFoundError:
        raise MscaleError("missing", file=join(ckpt, shard.path), code=EXIT_CRITICAL,
                          fix="run `mscale ckpt verify`; use an older checkpoint") from None
    if size != shard.bytes:
        fh.close()
        raise MscaleError(f"file has {size} bytes, the manifest says {shard.bytes} (truncated "
                          "or overwritten)", file=join(ckpt, shard.path), field="bytes",
                          code=EXIT_CRITICAL, fix="run `mscale ckpt verify`; use an older "
                                                  "checkpoint")
    return fh


def shard_slices(ckpt: str, m: Manifest, shard: ShardInfo) -> list[SliceInfo]:
    """A shard's slices: inline (schema 1) or from its index file, opened like a shard (inside
    the directory, a regular file of the recorded size) and checked (`checks.parse_index`)."""
    if shard.index is None:
        return shard.slices
    url = join(ckpt, shard.index.path)
    try:
        fh, size = open_inside(ckpt, shard.index.path)
    except FileNotFoundError:
        raise MscaleError("missing", file=url, code=EXIT_CRITICAL,
                          fix="run `mscale ckpt verify`; use an older checkpoint") from None
    except PermissionError as e:
        raise MscaleError(f"cannot read it: {e.strerror}", file=url,
                          fix="fix its permissions") from None
    with fh:
        if size != shard.index.bytes:  # the schema bounds the recorded size (MAX_INDEX_BYTES)
            raise MscaleError(f"file has {size} bytes, the manifest says {shard.index.bytes}",
                              file=url, field="index.bytes", code=EXIT_CRITICAL,
                              fix="run `mscale ckpt verify`; use an older checkpoint")
        data = fh.read(size + 1)
    return parse_index(data, url, m, shard)


INDEX_READERS = 16
"""Index files read at once when many are needed (an offline convert or verify, a reader whose
guess missed): small files on a shared filesystem, where latency, not bandwidth, is the cost."""


def shard_slices_many(ckpt: str, m: Manifest, shards: list[ShardInfo]) -> list:
    """`shard_slices` of each of ``shards``, read ``INDEX_READERS`` at a time, in order; a shard
    whose index cannot be used gives its exception in its place (the caller decides)."""
    def one(shard: ShardInfo):
        try:
            return shard_slices(ckpt, m, shard)
        except (MscaleError, OSError) as e:
            return e

    if len(shards) < 2 or all(s.index is None for s in shards):
        return [one(s) for s in shards]
    with ThreadPoolExecutor(INDEX_READERS, "mscale-ckpt-index") as pool:
        return list(pool.map(one, shards))


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
    step: int
    """The step its name says."""
    committed: bool
    bytes: int
    layout: dict | None
    manifest_step: int | None = None
    """The step its manifest says (None when not read or unreadable)."""
    problem: str | None = None
    """Why its manifest could not be read, for `ls`."""


def entries(ckpt_root: str, sizes: bool = True) -> list[Entry]:
    """The step-NNNNNN directories under a run's ckpt/, oldest first. With ``sizes`` (``ls``),
    also their sizes and what their manifests say; retention and resume need only the names."""
    fs, root = fs_and_path(ckpt_root)
    if not fs.isdir(root):
        return []
    out = []
    for info in fs.ls(root, detail=True):
        name = basename(info["name"])
        m = STEP_DIR.match(name)
        if not m or info.get("type") != "directory":
            continue
        committed = fs.exists(join(root, name, COMMITTED))
        entry = Entry(name, int(m.group(1)), committed, 0, None)
        if sizes:
            try:
                entry.bytes = sum(f.get("size") or 0 for f in fs.ls(join(root, name), detail=True))
            except FileNotFoundError:  # removed since the listing (a failed save cleaned up)
                continue
        if sizes and committed:
            try:  # checked against its marker, as a resume checks it: an edited one is refused
                manifest = load_committed(join(ckpt_root, name))
                entry.layout, entry.manifest_step = manifest.layout, manifest.step
            except MscaleError as e:
                entry.problem = f"{e.field + ': ' if e.field else ''}{e.message}"
        out.append(entry)
    return sorted(out, key=lambda e: e.step)


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
