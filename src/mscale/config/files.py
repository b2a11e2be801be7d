"""Reading a config, plan or HF ``config.json`` as text: bounded, never blocking, always UTF-8.

Whatever the operator points mscale at (a 2 GB log, a FIFO nobody writes to, a UTF-16 file saved
by an editor, a file they cannot read), the answer is one `MscaleError` naming the file and the
fix, never a traceback or a hang.
"""

from __future__ import annotations

import codecs
import os
import select
import stat
from pathlib import Path

from mscale.errors import MscaleError

MAX_CONFIG_BYTES = 64 * 2**20
"""Largest config or plan file read. A 12,288-GPU plan is 0.7 MB; one for the schemas' largest
cluster (~1M GPUs) stays below this."""

PIPE_WAIT_S = 10.0
"""How long a pipe or device (``--model /dev/stdin``, a shell's ``<(...)``) may stay silent
before it is given up: a FIFO that no process writes to must not hang the command."""

_CHUNK = 1 << 16
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def read_text(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> str:
    """Read a small UTF-8 text file, local or any fsspec URL, at most ``limit`` bytes."""
    return decode_text(read_bytes(path, limit), str(path))


def read_bytes(path: str | Path, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """Read at most ``limit`` bytes of a file; every failure is an MscaleError naming it.

    Local paths (no ``scheme://``) are opened without seeking, so non-seekable files such as
    ``/dev/stdin`` or a shell's ``<(...)`` pipe work; fsspec handles URLs.
    """
    text = str(path)
    try:
        return _read_url(text, limit) if "://" in text else _read_local(text, limit)
    except FileNotFoundError:
        raise MscaleError("file not found", file=text,
                          fix="check the path; relative paths are taken from the current "
                              "directory") from None
    except IsADirectoryError:
        raise MscaleError("is a directory, expected a file", file=text,
                          fix="give the file inside it") from None
    except PermissionError:
        raise MscaleError("permission denied", file=text,
                          fix="make the file readable by this user (chmod u+r), or copy it "
                              "somewhere readable") from None
    except OSError as e:
        raise MscaleError(f"cannot read: {e.strerror or e}", file=text,
                          fix="give a readable regular file") from None


def _too_big(text: str, limit: int) -> MscaleError:
    return MscaleError(f"larger than {limit / 2**20:g} MiB, too large for a config or plan",
                       file=text, fix="give the YAML/JSON file itself, not a log, checkpoint "
                                      "or data file")


def _read_url(text: str, limit: int) -> bytes:
    from mscale.urls import fs_and_path

    fs, path = fs_and_path(text)
    info = fs.info(path)
    if info.get("type") == "directory":
        raise IsADirectoryError(text)
    if (info.get("size") or 0) > limit:
        raise _too_big(text, limit)
    with fs.open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _too_big(text, limit)
    return data


def _read_local(text: str, limit: int) -> bytes:
    """Regular files are read directly; pipes and devices through `_read_stream`.

    The file is opened non-blocking: opening a FIFO for reading otherwise waits, forever, for a
    writer to appear.
    """
    fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(text)
        if stat.S_ISREG(st.st_mode):
            if st.st_size > limit:
                raise _too_big(text, limit)
            with os.fdopen(os.dup(fd), "rb") as f:
                # read(n) allocates n bytes up front: ask for the size, not the limit (64 MiB)
                data = f.read(st.st_size + 1)
                if len(data) > st.st_size:  # it grew since fstat: read on, within the limit
                    data += f.read(limit + 1 - len(data))
        else:
            data = _read_stream(fd, text, limit)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _too_big(text, limit)
    return data


def _read_stream(fd: int, text: str, limit: int) -> bytes:
    """Read a pipe or device to its end, giving up after `PIPE_WAIT_S` without any data."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks, size = [], 0
    while size <= limit:
        if not poller.poll(PIPE_WAIT_S * 1000):
            raise MscaleError(f"nothing arrived from this pipe or device in {PIPE_WAIT_S:g} s",
                              file=text, fix="give a regular file, or start the process that "
                                             "writes to the pipe first")
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:  # woken without data (a writer came and went)
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def decode_text(data: bytes, source: str) -> str:
    """UTF-8 text of a config (a UTF-8 byte-order mark is dropped); anything else is refused.

    UTF-16/32 files (BOM or NUL bytes) and binary files get a message that says what they look
    like, since "invalid start byte at position 0" helps nobody.
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise _not_utf8(source, f"{name} text")
    nul = data.find(b"\x00")
    if nul >= 0:
        looks = "UTF-16 text" if _looks_utf16(data[:256]) else "binary data"
        raise _not_utf8(source, f"{looks} (NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(source, f"binary data (byte 0x{data[e.start]:02x} at offset {e.start} "
                                "is not UTF-8)") from None


def _looks_utf16(sample: bytes) -> bool:
    """Mostly-ASCII UTF-16 without a BOM: every other byte is NUL, the others are not."""
    even, odd = sample[0::2], sample[1::2]
    zeros, other = sorted((even.count(0), odd.count(0)), reverse=True)
    return bool(odd) and zeros * 4 >= len(odd) * 3 and other * 8 <= len(odd)


def _not_utf8(source: str, what: str) -> MscaleError:
    return MscaleError(f"expected UTF-8 YAML/JSON text, found {what}", file=source,
                       fix="give the config file itself, saved as UTF-8 (e.g. iconv -f UTF-16 "
                           "-t UTF-8 FILE > NEW.yaml)")
