"""Writes that a crash can never leave half-done, locally or through fsspec.

Whole files (`write_bytes_atomic`): a reader that finds a file trusts it, so no file may appear
before it is complete. Locally the bytes go to a temp file that is fsynced, renamed over the target,
and the directory fsynced, so the rename survives a power loss too. On object stores (s3, gs, azure,
memory) one PUT (``pipe_file``) is already atomic and a "rename" would be a copy, so the object is
written in place; other remote filesystems (sftp, ...) get the temp-file-and-rename.

JSONL appends (`append_line`, metrics.jsonl and events.jsonl) write one whole line or nothing:

- locally the file is opened ``O_APPEND`` and ``flock``-ed for the append, so writers that share
  the file (threads, ``watch`` beside ``train``) never interleave; a short ``os.write`` is
  continued until the whole line is written. If a write fails midway the file is truncated back to
  its size before the append. A torn tail left by a process killed mid-append is repaired before
  the next line goes on (kept, with its newline, if it is a complete record; cut off if it is
  not), so a torn line is only ever the last one. ENOSPC/EDQUOT become `DiskFullError` (exit 3).
- object stores have no append, and rewriting the whole file made a run O(steps²). Each record is
  instead one small object ``<file>.d/<stamp>-<pid>-<token>.jsonl`` written with one PUT, where
  ``stamp`` is nanoseconds, strictly increasing per writer and above every stamp already there when
  the writer first appended to that file (one listing per file per process). Names sort in append
  order; two processes' records interleave by clock.
- one in-process lock per file serialises threads (the checkpoint writer and the training loop).

`read_jsonl` is the one reader for both: the base file (where a local append goes, or what an older
run wrote whole), then the segments in name order. A torn last line of the base file is skipped;
any other bad line is an error naming the file and line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import threading
import time
import uuid
from contextlib import contextmanager, suppress
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.errors import MscaleError
from mscale.urls import fs_and_path

SEGMENTS = ".d"
"""Suffix of the directory holding a JSONL file's appended records on object stores."""
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci",
                            "memory"})
_FULL = (errno.ENOSPC, errno.EDQUOT)
_SEGMENT_NAME = re.compile(r"^(\d{20})-\d+-[0-9a-f]+\.jsonl$")
_TOKEN = uuid.uuid4().hex[:8]


class DiskFullError(MscaleError):
    """The filesystem under a run directory is full (or over quota).

    Its own type so that the training loop can stop cleanly at a step boundary with one line
    instead of crashing; the message says the disk is full and ``file`` names what could not be
    written.
    """

    @classmethod
    def of(cls, url: str, err: OSError) -> "DiskFullError":
        reason = "over quota" if err.errno == errno.EDQUOT else "no space left"
        return cls(f"the disk is full ({reason}): could not write to this file", file=url,
                   fix="free space (or raise the quota) on that filesystem, or use a --run-dir "
                       "elsewhere, then resume from the last checkpoint")


def is_disk_full(exc: BaseException) -> bool:
    """A full filesystem or quota, however it was reported: a `DiskFullError`, or a raw
    ENOSPC/EDQUOT from code that writes outside this module (the checkpoint writer, fsspec)."""
    return isinstance(exc, DiskFullError) or (isinstance(exc, OSError) and exc.errno in _FULL)


@contextmanager
def disk_full_as_error(url: str) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT raised inside the block into `DiskFullError` naming ``url``."""
    try:
        yield
    except OSError as e:
        if e.errno in _FULL:
            raise DiskFullError.of(url, e) from None
        raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - some filesystems refuse to open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return any(p in _OBJECT_STORES for p in protocols)


def _put_whole(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write a remote file so that readers see all of it or none of it (see module docstring)."""
    if _is_object_store(fs):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, path)
    if fs.exists(tmp):  # webhdfs answers a rename onto an existing file with `false`, silently
        with suppress(OSError):
            fs.rm(tmp)
        raise OSError(f"{fs.protocol}: renaming {tmp} onto {path} left the old file in place "
                      "(this filesystem's rename does not replace a file)")


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` so that readers see either the old file or the whole new one."""
    fs, path = fs_and_path(url)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if not isinstance(fs, LocalFileSystem):
        _put_whole(fs, path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with disk_full_as_error(url), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(parent or ".")


def write_text_atomic(url: str, text: str) -> None:
    write_bytes_atomic(url, text.encode())


def write_json_atomic(url: str, obj: Any) -> None:
    write_text_atomic(url, json.dumps(obj, indent=2, sort_keys=False) + "\n")


_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LAST_STAMP: dict[tuple[str, str], int] = {}
_LOCKS_GUARD = threading.Lock()


def _path_lock(key: tuple[str, str]) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


def _key(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, str]:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, os.path.abspath(path) if isinstance(fs, LocalFileSystem) else path


def append_line(url: str, line: str) -> None:
    """Append one JSONL record as a whole line, or raise and leave the file as it was.

    Locally: ``O_APPEND`` + ``flock``, short writes continued, a failed write truncated away,
    ENOSPC/EDQUOT as `DiskFullError`. Object stores: one segment object per record. See the
    module docstring for why.
    """
    fs, path = fs_and_path(url)
    data = (line.rstrip("\n") + "\n").encode()
    key = _key(fs, path)
    with _path_lock(key):
        if isinstance(fs, LocalFileSystem):
            _append_local(url, path, data)
        else:
            _append_segment(fs, key, path, data)


def _append_local(url: str, path: str, data: bytes) -> None:
    parent = os.path.dirname(path)
    with disk_full_as_error(url):
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with _flock(fd), disk_full_as_error(url):
            start = _mend_torn_tail(fd)
            try:
                write_all(fd, data)
            except BaseException:
                with suppress(OSError):  # else the next append's _mend_torn_tail cuts it
                    os.ftruncate(fd, start)  # never leave part of this line before the next one
                raise
    finally:
        os.close(fd)


@contextmanager
def _flock(fd: int) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``fd`` (no-op where the filesystem has no locks)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        locked = True
    except OSError:  # pragma: no cover - e.g. some network filesystems
        locked = False
    try:
        yield
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may be short, e.g. near a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def _mend_torn_tail(fd: int) -> int:
    """Make the file end with a newline before appending; return its size.

    A file not ending in a newline was left by a writer killed mid-append (writers hold the
    flock, so none is still writing it). A tail that is a whole JSON record only lost its newline,
    which is added back; anything else was never a record and is cut off.
    """
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    start = size
    while start > 0:
        lo = max(0, start - 65536)
        nl = os.pread(fd, start - lo, lo).rfind(b"\n")
        if nl >= 0:
            start = lo + nl + 1
            break
        start = lo
    try:
        json.loads(os.pread(fd, size - start, start))
    except ValueError:
        os.ftruncate(fd, start)
        return start
    write_all(fd, b"\n")
    return size + 1


def _append_segment(fs: fsspec.AbstractFileSystem, key: tuple[str, str], path: str,
                    data: bytes) -> None:
    """Write one record as its own object under ``<path>.d/`` (caller holds the path lock)."""
    folder = path + SEGMENTS
    last = _LAST_STAMP.get(key)
    if last is None:  # first append to this file by this process: start above what is there
        fs.makedirs(folder, exist_ok=True)
        last = max((int(m.group(1)) for m in map(_segment_match, _segment_paths(fs, path)) if m),
                   default=0)
    stamp = max(time.time_ns(), last + 1)
    _put_whole(fs, f"{folder}/{stamp:020d}-{os.getpid()}-{_TOKEN}.jsonl", data)
    _LAST_STAMP[key] = stamp


def _segment_match(seg: str) -> re.Match | None:
    return _SEGMENT_NAME.match(seg.rsplit("/", 1)[-1])


def _segment_paths(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """The segment objects of a JSONL file, in append order."""
    folder = path + SEGMENTS
    if not fs.isdir(folder):
        return []
    found = [p for p in fs.ls(folder, detail=False) if _segment_match(p)]
    return sorted(found, key=lambda p: p.rsplit("/", 1)[-1])


def read_jsonl(url: str) -> list[dict]:
    """Read a JSONL file and its appended segments (module docstring); a torn last line of the
    base file (crash mid-append) is skipped, any other bad line is an error."""
    fs, path = fs_and_path(url)
    out = _parse(fs.cat_file(path), url, torn_tail_ok=True) if fs.isfile(path) else []
    segments = _segment_paths(fs, path)
    if segments:
        blobs = fs.cat(segments)  # concurrent GETs on async filesystems
        for seg in segments:
            raw = blobs[seg] if seg in blobs else fs.cat_file(seg)
            out += _parse(raw, f"{url}{SEGMENTS}/{seg.rsplit('/', 1)[-1]}",
                          torn_tail_ok=False)
    return out


def _parse(raw: bytes, source: str, torn_tail_ok: bool) -> list[dict]:
    # "\n" only: str.splitlines also splits at U+2028, U+2029 and U+0085, which JSON writes
    # raw inside a string (an OSError's text, a path), and the line would no longer parse
    lines = raw.decode(errors="replace").rstrip("\n").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if torn_tail_ok and i == len(lines) - 1:
                break
            raise MscaleError(f"line {i + 1} is not valid JSON", file=source,
                              fix="the file is corrupt; move the bad line away") from None
    return out
