"""Check, before any work starts, that a command can write where it was told to.

A plan search, a checkpoint conversion or an 8-process job that fails only at its last step
because ``-o README.md/plan.yaml`` names a path under a regular file wastes the work and ends in a
traceback. Every command that writes calls `check_output` on its destinations first: one line
naming the path and the fix, exit 3.
"""

from __future__ import annotations

import os
from typing import Literal

from fsspec.implementations.local import LocalFileSystem

from mscale.errors import MscaleError
from mscale.runs.atomic import fs_and_path

Kind = Literal["file", "dir"]


def check_lasting(url: str, what: str) -> None:
    """Refuse a ``memory://`` destination for a command's output: fsspec's memory filesystem
    lives inside one process, so what a command (or its workers, each with its own) writes there
    is gone when it exits, though it said "committed" or "wrote". The library accepts it (tests
    run whole conversions in memory); the commands do not."""
    if url.startswith("memory://"):
        raise MscaleError("memory:// lives only inside the process that writes it: nothing "
                          "would be left when the command ends", file=url,
                          field=what, fix="give a local path or a lasting fsspec URL "
                          "(file://, s3://, gs://, ...)")


def check_not_an_input(url: str, what: str, inputs: list[tuple[str, str]]) -> None:
    """Refuse a destination that is one of the command's own inputs (``inputs``: (option,
    path) pairs), compared by resolved path locally and as written otherwise: ``mscale plan
    --training t.yaml -o t.yaml`` replaced the training file with the plan, its comments lost,
    and the next run of the same line was refused as 'a whole plan given as --training'."""
    def key(u: str) -> str:
        return u if "://" in u else os.path.realpath(u)

    for option, path in inputs:
        if path and key(path) == key(url):
            raise MscaleError(f"this is the {option} file: writing there would replace that "
                              "input", file=url, field=what,
                              fix=f"give {what} another file, e.g. plan.yaml")


def check_output(url: str, kind: Kind, what: str, example: str = "plan.yaml") -> None:
    """Raise MscaleError unless ``url`` can be written as a ``kind`` (a file or a directory).

    ``what`` names the option the path came from (``-o``, ``--run-dir``), so the message points at
    what the user typed; ``example`` is the file name a directory given for a file is told to
    hold (``mscale.prom`` for ``--prometheus``, not a plan). Local paths are checked for real
    (the nearest existing ancestor must be a writable directory, the path itself must not be of
    the other kind); for object stores only the protocol is resolved, since their permissions
    show only on the first write.
    """
    fs, path = fs_and_path(url)  # an unknown protocol fails here
    if not isinstance(fs, LocalFileSystem):
        if kind == "dir" and fs.isfile(path):
            raise MscaleError(f"{what} names a file, expected a directory", file=url,
                              fix=f"give {what} a new or existing directory")
        return
    if os.path.lexists(path):
        _check_existing(url, path, kind, what, example)
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MscaleError(f"{what}: cannot create it because {parent} is a file, not a directory",
                          file=url, fix=f"choose a {kind} path whose parents are directories")
    if not os.access(parent, os.W_OK | os.X_OK):
        _read_only(parent, url, what)
        raise MscaleError(f"{what}: no permission to create it in {parent}", file=url,
                          fix=f"choose a writable location for {what}, or fix the permissions")
    _refuse_kernel_fs(parent, url, what, kind)


PSEUDO_FILESYSTEMS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2",
                                "debugfs", "tracefs", "securityfs", "configfs", "pstore",
                                "bpf", "efivarfs", "fusectl", "mqueue", "hugetlbfs"})
"""Kernel filesystems where no command's output can be created (/proc, /sys, ...)."""


def _refuse_kernel_fs(directory: str, url: str, what: str, kind: Kind) -> None:
    """Refuse a place on a kernel pseudo-filesystem: `os.access` says yes to root there (under
    /proc too), and the command failed at its last step. Read from the mount table, never by
    writing: every rank of an srun job checks its run directory at once, and a probe file each
    created and removed there failed one rank with ENOENT while the others set the directory up
    (CI48, the srun preflight test)."""
    fstype = _fstype(os.path.realpath(directory))
    if fstype in PSEUDO_FILESYSTEMS:
        raise MscaleError(f"{what}: {directory} is on the kernel's {fstype} filesystem, where "
                          "nothing can be created", file=url,
                          fix=f"choose a {kind} path on a writable filesystem for {what}")


def _fstype(path: str) -> str | None:
    """The filesystem type of the mount that holds ``path`` (/proc/self/mounts; None where
    there is no such table)."""
    best, found = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, found = point, parts[2]
    except OSError:
        return None
    return found


def _read_only(path: str, url: str, what: str) -> None:
    """Raise the error of a read-only filesystem, which `os.access` reports as a refusal too: its
    fix is a remount, not a permission."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return
    if read_only:
        raise MscaleError(f"{what}: {path} is on a read-only filesystem", file=url,
                          fix=f"choose a location on a writable filesystem for {what}, or "
                              "remount it read-write")


def _check_existing(url: str, path: str, kind: Kind, what: str, example: str) -> None:
    if kind == "file":
        if os.path.isdir(path):
            raise MscaleError(f"{what} names a directory, expected a file", file=url,
                              fix=f"give {what} a file name, e.g. {os.path.join(url, example)}")
        if not os.path.isfile(path):
            raise MscaleError(f"{what} names something that is not a regular file", file=url,
                              fix=f"give {what} a regular file path")
        if not os.access(path, os.W_OK):
            _read_only(path, url, what)
            raise MscaleError(f"{what}: no permission to overwrite it", file=url,
                              fix="choose another path, or fix the file's permissions")
        return
    if not os.path.isdir(path):
        raise MscaleError(f"{what} names a file, expected a directory", file=url,
                          fix=f"give {what} a new or existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        _read_only(path, url, what)
        raise MscaleError(f"{what}: no permission to write in it", file=url,
                          fix=f"choose a writable directory for {what}, or fix the permissions")
    _refuse_kernel_fs(path, url, what, kind)
