"""Writes that a crash can never leave half-done: temp file + rename, locally or through fsspec.

A reader that finds a file trusts it, so no file may appear before it is complete. Locally the
temp file is fsynced before the rename and the directory after it, so the rename survives a power
loss too. On object stores (s3://, gs://) a single PUT is already atomic, so the temp step is
skipped there.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.errors import MscaleError


def fs_and_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Split a local path or fsspec URL into (filesystem, path inside it).

    An unknown scheme (``foo://``) or one whose package is not installed (``s3://`` without s3fs)
    is bad input, named as such, not a traceback from deep inside fsspec.
    """
    text = str(url)
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        scheme = text.split("://", 1)[0]
        raise MscaleError(f"unknown storage protocol {scheme!r}", file=text,
                          fix="use a local path or an fsspec URL whose protocol is installed "
                              "(file://, memory://, s3:// with s3fs, gs:// with gcsfs, ...)") from None
    except ImportError as e:
        raise MscaleError(f"the package for this URL's protocol is not installed ({e})", file=text,
                          fix="install the fsspec implementation it names, or use a local path") from None
    return fs, path


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


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` so that readers see either the old file or the whole new one."""
    fs, path = fs_and_path(url)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(parent or ".")
    else:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)


def write_text_atomic(url: str, text: str) -> None:
    write_bytes_atomic(url, text.encode())


def write_json_atomic(url: str, obj: Any) -> None:
    write_text_atomic(url, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def append_line(url: str, line: str) -> None:
    """Append one line (JSONL records). Each line is written with a single write call so that a
    crash leaves at most one torn last line, which readers skip (see `read_jsonl`)."""
    fs, path = fs_and_path(url)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if isinstance(fs, LocalFileSystem):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line.rstrip("\n") + "\n").encode())
        finally:
            os.close(fd)
    else:  # object stores have no append: rewrite (fine for the low rate of events)
        old = fs.cat_file(path) if fs.exists(path) else b""
        write_bytes_atomic(url, old + (line.rstrip("\n") + "\n").encode())


def read_jsonl(url: str) -> list[dict]:
    """Read a JSONL file; a torn last line (crash mid-append) is skipped, any other bad line is
    an error."""
    fs, path = fs_and_path(url)
    if not fs.exists(path):
        return []
    lines = fs.cat_file(path).decode().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise MscaleError(f"line {i + 1} is not valid JSON", file=url,
                              fix="the file is corrupt; move the bad line away")
    return out
