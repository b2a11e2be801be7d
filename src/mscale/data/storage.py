"""Bytes of one file, local or remote, read without ever hanging the training job.

Why: training reads token files for weeks, from local disks and from object stores that
sometimes fail a request or never answer it. A hung read stalls every rank behind a collective,
a silent short read trains on garbage. So:

- local files are memory-mapped: a read is a slice, the page cache does the rest;
- remote files (any other fsspec protocol) are read by byte range through a small LRU cache of
  ``block_bytes`` blocks, so consecutive samples do not cost one request each;
- every remote call runs in a worker thread and is abandoned after ``timeout_s``; failures are
  retried with exponential backoff; in the end one `MscaleError` (exit 3) names the URL, the
  attempts and the last error. A missing file or a permission error is not retried.

Blobs are thread safe: the loader's prefetch thread and the training thread read the same one.
The package's local writers share `fsync_dir` from here.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import random
import stat
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.errors import MscaleError
from mscale.urls import fs_and_path

T = TypeVar("T")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
"""Errors a retry cannot fix: reported at once, naming the file."""
_GLOB_CHARS = "*?["
BLOCK_BYTES = 256 << 10
"""Bytes per remote range read. Shuffled training reads one sample (4 KiB at seq 2,048) from a
random place: every byte of a block beyond it is paid for in bandwidth, and a block far larger
does not save a request (measured, docs/benchmarks.md "Data path"). 256 KiB keeps that to 64x
while a file read in order still takes few requests."""
CACHE_BYTES = 64 << 20
"""Remote blocks one process keeps, over all the files it reads (one LRU): a source read in
order, or a small one, is fetched once. It was 16 MiB per file, a total that grew with every
shard a shuffled run touches: the ~3,700 shards of a trillion tokens would have held ~58 GiB in
each reader."""


class _BlockCache:
    """The process's cache of remote blocks, keyed by (blob, block index), bounded in bytes."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int]) -> bytes | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def put(self, key: tuple[int, int], data: bytes) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = data
            self._bytes += len(data)
            while self._bytes > CACHE_BYTES and len(self._blocks) > 1:
                self._bytes -= len(self._blocks.popitem(last=False)[1])


_CACHE = _BlockCache()
_BLOB_IDS = itertools.count()
"""A key per opened blob, never reused (an object's id is): a new blob never reads another's."""


class Retry:
    """How remote calls are bounded: ``retries`` after the first attempt, each ``timeout_s`` at
    most, waiting ``backoff_s * 2**i`` (at most ``max_wait_s``, times a random 0.5-1.5) before
    retry i."""

    def __init__(self, retries: int = 4, backoff_s: float = 0.5, timeout_s: float = 60.0,
                 max_wait_s: float = 30.0) -> None:
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.max_wait_s = max_wait_s

    @classmethod
    def within(cls, patience_s: float, timeout_s: float = 60.0) -> Retry:
        """As many retries as their waits (0.5 s doubling, at most 30 s each) fit in
        ``patience_s``: 7.5 s gives the default 4, 120 s gives 8, 600 s gives 24."""
        r, waited = cls(0, timeout_s=timeout_s), 0.0
        while r.wait(r.retries + 1) < r.max_wait_s:  # the doubling waits
            if waited + r.wait(r.retries + 1) > patience_s:
                return r
            r.retries += 1
            waited += r.wait(r.retries)
        r.retries += int((patience_s - waited) // r.max_wait_s)  # then 30 s each
        return r

    def wait(self, i: int) -> float:
        """The nominal wait before retry ``i`` (1 first), before its jitter."""
        return min(self.backoff_s * 2.0 ** min(i - 1, 60), self.max_wait_s)  # no float overflow

    def call(self, url: str, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` with timeout and retries, or an `MscaleError` naming ``url`` and ``what``."""
        last: BaseException | None = None
        attempts = self.retries + 1
        for i in range(attempts):
            if i:  # jittered: thousands of readers throttled together must not retry in step
                time.sleep(self.wait(i) * random.uniform(0.5, 1.5))
            try:
                return _bounded(fn, self.timeout_s)
            except MscaleError:
                raise
            except _PERMANENT as e:
                raise _permanent(url, e) from None
            except Exception as e:  # any backend's transient error (OSError, botocore, aiohttp...)
                last = e
        # ``what`` is the field, which the error line prints before the message already
        tries = f"{attempts} attempt" + ("s" if attempts != 1 else "")  # remote_retry_s: 0
        raise MscaleError(f"failed after {tries} (timeout {self.timeout_s:g} s "
                          f"each); last error: {type(last).__name__}: {last}", file=url,
                          field=what,
                          fix="check that the store is reachable and the file readable, then "
                              "rerun (the job resumes from its last checkpoint); raise "
                              "training.data.remote_retry_s if its outages last longer")


_default = Retry()
"""What a remote call gets when its caller names no `Retry`: the training file's
``data.remote_retry_s`` once `set_default_retry` has been called (blend.open_sources), 7.5 s of
waiting otherwise (the CLI's tools: a store that is down is said at once)."""


def set_default_retry(retry: Retry) -> None:
    """Every later remote call and opened file without a `Retry` of its own uses ``retry``: the
    process reads one training file, and the reads it makes go through many modules."""
    global _default
    _default = retry


def _bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in a daemon thread and wait at most ``timeout_s``.

    A fresh thread per call, not a pool: a call that hangs forever keeps its thread, and a pool's
    threads would all end up stuck. Daemon, so a stuck one never blocks interpreter exit.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e
        done.set()

    threading.Thread(target=run, name="mscale-io", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _permanent(url: str, e: BaseException) -> MscaleError:
    what = {FileNotFoundError: "no such file", PermissionError: "permission denied",
            IsADirectoryError: "is a folder, not a file",
            NotADirectoryError: "a parent of it is not a folder"}.get(type(e), str(e))
    return MscaleError(what, file=url, fix="check the path and its access rights")


class Blob:
    """The bytes of one file: ``read(offset, length)``; ``size`` is known at open."""

    url: str
    size: int

    def read(self, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise MscaleError(f"read of bytes [{offset}, {offset + length}) is outside the file "
                              f"({self.size} bytes)", file=self.url, field="size",
                              fix="the file changed or is truncated; regenerate it")


class LocalBlob(Blob):
    """A memory-mapped local file; an empty file has no mapping and reads nothing."""

    def __init__(self, url: str, path: str) -> None:
        self.url = url
        try:  # stat first: opening a FIFO with no writer would wait forever
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise MscaleError("not a regular file (a folder, FIFO or device)", file=url,
                                  fix="name a token file, a Megatron prefix or a prepared folder")
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except _PERMANENT as e:
            raise _permanent(url, e) from None
        except OSError as e:
            raise MscaleError(f"cannot open: {e}", file=url,
                              fix="check the path and the disk") from None

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        if not length:
            return b""
        return self._map[offset:offset + length]  # mmap slicing is thread safe (no file position)


class RemoteBlob(Blob):
    """Range reads through an LRU cache of aligned blocks, every request bounded by `Retry`."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, path: str, retry: Retry,
                 block_bytes: int, size: int | None = None) -> None:
        self.url, self._fs, self._path, self._retry = url, fs, path, retry
        self.block_bytes = block_bytes
        self.size = int(size if size is not None else retry.call(url, "size",
                                                                 lambda: fs.size(path)))
        self._key = next(_BLOB_IDS)

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        if not length:
            return b""
        first, last = offset // self.block_bytes, (offset + length - 1) // self.block_bytes
        parts = [self._block(b) for b in range(first, last + 1)]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        start = offset - first * self.block_bytes
        return data[start:start + length]

    def _block(self, index: int) -> bytes:
        cached = _CACHE.get((self._key, index))
        if cached is not None:
            return cached
        # fetched outside the cache's lock: a slow request must not stall readers of cached blocks
        start = index * self.block_bytes
        end = min(start + self.block_bytes, self.size)
        data = self._retry.call(self.url, f"bytes[{start}:{end}]", lambda: self._fetch(start, end))
        _CACHE.put((self._key, index), data)
        return data

    def _fetch(self, start: int, end: int) -> bytes:
        data = self._fs.cat_file(self._path, start=start, end=end)
        if len(data) != end - start:  # a short answer is a failure to retry, never a misread
            raise OSError(f"short read: {len(data)} of {end - start} bytes")
        return bytes(data)


def open_blob(url: str, *, retry: Retry | None = None, block_bytes: int = BLOCK_BYTES,
              size: int | None = None) -> Blob:
    """Open one file for reading: memory-mapped when local, range-read and cached when remote,
    every request bounded by ``retry`` (default: `set_default_retry`'s). ``size``, known from a
    listing (`sizes`), spares a remote file its own size request."""
    fs, path = fs_and_path(url)
    if isinstance(fs, LocalFileSystem):
        return LocalBlob(url, path)
    return RemoteBlob(url, fs, path, retry or _default, block_bytes, size)


def kind(url: str, retry: Retry | None = None) -> str | None:
    """``"file"``, ``"dir"`` or None (nothing there), with the same timeout and retries."""
    fs, path = fs_and_path(url)
    retry = retry or _default

    def look() -> str | None:
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        return "dir" if info.get("type") == "directory" else "file"
    return retry.call(url, "info", look)


def join(url: str, name: str) -> str:
    """``url/name`` for a local path or an fsspec URL (fsspec paths always use ``/``)."""
    return url.rstrip("/") + "/" + name


def expand(spec: str, retry: Retry | None = None) -> list[str]:
    """A path, fsspec URL, folder or glob → the sorted files it names (URLs keep their protocol).

    A folder gives the files directly inside it (not recursive); a glob its matching files. No
    match is an error naming the spec: a typo must not train on an empty set.
    """
    fs, path = fs_and_path(spec)
    retry = retry or _default
    local = isinstance(fs, LocalFileSystem)

    def name(p: str) -> str:
        return p if local else fs.unstrip_protocol(p)

    def find() -> list[str]:
        if any(c in spec for c in _GLOB_CHARS):
            return [p for p, info in fs.glob(path, detail=True).items()
                    if info.get("type") != "directory"]
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return []
        if info.get("type") != "directory":
            return [path]
        return [i["name"] for i in fs.ls(path, detail=True) if i.get("type") != "directory"]

    found = sorted(name(p) for p in retry.call(spec, "list", find))
    if not found:
        folders = (sorted(name(p) for p in fs.glob(path)) if any(c in spec for c in _GLOB_CHARS)
                   else [])
        if folders:  # a glob matches files only: `data/cod*` meant the folder data/code
            raise MscaleError(f"no file matches, only folder(s): {', '.join(folders[:3])}"
                              + (" ..." if len(folders) > 3 else ""), file=spec,
                              fix=f"name the folder itself ({folders[0]}), or glob the files "
                                  "inside it")
        raise MscaleError("no file matches", file=spec,
                          fix="check the path, folder or glob pattern")
    return found


def sizes(folder: str, retry: Retry | None = None) -> dict[str, int]:
    """Name → size in bytes of each file directly inside ``folder``, from one listing: an object
    store lists a thousand keys a request, where a size request per file is a round trip each
    (every rank opens every shard at the start)."""
    fs, path = fs_and_path(folder)

    def listing() -> dict[str, int]:
        return {i["name"].rstrip("/").rsplit("/", 1)[-1]: int(i["size"])
                for i in fs.ls(path, detail=True) if i.get("type") != "directory"}
    return (retry or _default).call(folder, "list", listing)


def sha256(url: str, chunk_bytes: int = 8 << 20) -> str:
    """The sha256 of a whole file, streamed ``chunk_bytes`` at a time (verification, not open)."""
    blob, h = open_blob(url, block_bytes=chunk_bytes), hashlib.sha256()
    for offset in range(0, blob.size, chunk_bytes):
        h.update(blob.read(offset, min(chunk_bytes, blob.size - offset)))
    return h.hexdigest()


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in the local folder ``path`` durable (the package's writers:
    `IndexedWriter`, `prepare`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_parents(path: str, out: str, field: str) -> None:
    """Refuse a local output ``path`` (``out`` as typed) that cannot be created because an
    existing ancestor is a file, before any work: otherwise the write fails at the end with a
    bare ``OSError`` naming a temporary path (``DIR.tmp-<pid>: Not a directory``)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MscaleError(f"cannot create it because {parent} is a file, not a folder",
                          file=out, field=field, fix=f"choose a {field} whose parents are folders")
