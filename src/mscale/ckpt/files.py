"""Opening the files a checkpoint holds, refusing what is not one: a regular file (a FIFO would
block the reader, a directory or device is never a checkpoint file), inside the checkpoint
directory (a manifest's name or a symlink cannot lead out), of the size the manifest records
(its slices lie inside that size, so no read goes past the end), and small files bounded before
they are read. Local paths and fsspec URLs alike.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.ckpt import untrusted
from mscale.ckpt.checks import parse_index
from mscale.ckpt.limits import MAX_SMALL_BYTES
from mscale.ckpt.manifest import Manifest, ShardInfo, SliceInfo, check_relative
from mscale.errors import EXIT_CRITICAL, MscaleError
from mscale.runs.atomic import fs_and_path


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def _not_regular(url: str, kind: str) -> MscaleError:
    return MscaleError(f"is {kind}, not a regular file", file=url, code=EXIT_CRITICAL,
                       fix="the checkpoint was altered; move it away and use an older one")


def open_regular(url: str) -> tuple[object, int]:
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
        fh, size = open_regular(url)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError as e:
        raise MscaleError(f"cannot read it: {e.strerror}", file=url, fix="fix its permissions")
    with fh:
        if size > limit:
            raise MscaleError(f"is {size} bytes, more than the {limit} it may have", file=url,
                              code=EXIT_CRITICAL, fix=untrusted.DAMAGED)
        return fh.read(limit + 1)


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
    return open_regular(url)


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
