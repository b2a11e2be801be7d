"""Compressed corpus files whose damage is an error that names the file.

`mscale data prepare` reads ``.gz``, ``.zst``, ``.bz2`` and ``.xz`` inputs. A file cut short (a
copy that stopped, a full disk at the writer) must not become a shorter corpus in silence:

- zstandard's stream reader, which fsspec uses for ``.zst``, stops at the end of the input even
  in the middle of a frame: a truncated ``.txt.zst`` read as an empty document and a truncated
  ``.jsonl.zst`` as a last line that is "not JSON". `ZstdFrames` decompresses frame by frame
  (files of several concatenated frames included) and refuses an input that ends inside one;
- gzip, bz2 and lzma do notice, but as ``EOFError`` or their own exception classes, which reached
  the console as "internal error" naming no file. `Checked` turns each into one `MscaleError`
  naming the file.
"""

from __future__ import annotations

import gzip
import io
import lzma
import zlib
from typing import Iterator

from mscale.errors import MscaleError

CHUNK = 1 << 20
"""Compressed bytes read at a time."""

FEED = 1 << 12
"""Compressed bytes given to the decompressor at a time: a zstd block can expand ~30,000× (zeros,
a repeated line), so one whole CHUNK could come out as tens of GiB in one call; 4 KiB is at
most ~128 MiB, and text compresses 3-5×."""

MAX_WINDOW = 1 << 31
"""Largest zstd window accepted: what ``zstd --long=31`` writes (the library's default limit
refuses it as "Frame requires too much memory")."""

DAMAGE = (EOFError, zlib.error, lzma.LZMAError, OSError)
"""What a damaged or truncated stream raises from gzip, bz2 (``OSError: Invalid data stream``)
and lzma; zstandard's is `zstandard.ZstdError`, added where it is imported."""

FIX = "copy or download the file again (it is truncated or damaged), or leave it out"


def damaged(url: str, why: str) -> MscaleError:
    return MscaleError(f"the compressed file is truncated or damaged ({why})", file=url, fix=FIX)


class ZstdFrames(io.RawIOBase):
    """A ``.zst`` stream, decompressed frame by frame; ``read`` raises when the input ends inside
    a frame."""

    def __init__(self, raw, url: str):
        import zstandard

        self.raw, self.url = raw, url
        self._dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        self._error = zstandard.ZstdError
        self._chunks = self._decompressed()
        self._pending = b""

    def _decompressed(self) -> Iterator[bytes]:
        frame = None
        while True:
            block = self.raw.read(CHUNK)
            if not block:
                if frame is not None:
                    raise damaged(self.url, "it ends inside a zstd frame")
                return
            at = 0
            while at < len(block):
                if frame is None:
                    frame = self._dctx.decompressobj()
                piece, at = block[at:at + FEED], at + FEED
                try:
                    out = frame.decompress(piece)
                except self._error as e:
                    raise damaged(self.url, f"zstd: {e}") from None
                if out:
                    yield out
                if frame.eof:  # a frame ended: what follows starts the next
                    block, at, frame = frame.unused_data + block[at:], 0, None

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, have = [self._pending], len(self._pending)
        while size < 0 or have < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            parts.append(chunk)
            have += len(chunk)
        data = b"".join(parts)
        if size < 0:
            self._pending = b""
            return data
        self._pending = data[size:]
        return data[:size]

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            super().close()


class Checked:
    """A decompressing file whose reads raise a named `MscaleError` on damage; everything else
    is the file's own (a context manager, ``seek`` for parquet)."""

    def __init__(self, f, url: str):
        self._f, self.url = f, url

    def read(self, size: int = -1) -> bytes:
        try:
            return self._f.read(size)
        except MscaleError:
            raise
        except DAMAGE as e:
            if isinstance(e, OSError) and not _looks_like_damage(e):
                raise
            raise damaged(self.url, f"{type(e).__name__}: {e}") from None

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self) -> "Checked":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _looks_like_damage(e: OSError) -> bool:
    """bz2 raises a plain OSError for bad data, gzip its BadGzipFile, neither with an errno. A
    real I/O error has one, and a subclass without (a remote read's TimeoutError) is the
    filesystem's or the network's, not the file's."""
    return e.errno is None and (type(e) is OSError or isinstance(e, gzip.BadGzipFile))


def open_compressed(fs, path: str, url: str, compression: str | None):
    """``fs.open`` of a corpus file, decompressed and checked as the module docstring says."""
    if compression == "zstd":
        return Checked(ZstdFrames(fs.open(path, "rb"), url), url)
    f = fs.open(path, "rb", compression=compression)
    return Checked(f, url) if compression else f
