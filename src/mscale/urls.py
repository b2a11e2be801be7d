"""Local paths and fsspec URLs: the one place a location string becomes a filesystem.

A leaf module (it imports only fsspec and errors) so that every layer — config reading a plan,
runs writing records, ckpt reading shards — resolves locations the same way, and an unknown
protocol is the same clean error everywhere.
"""

from __future__ import annotations

import os

import fsspec

from mscale.errors import MscaleError


def fs_and_path(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Split a local path or fsspec URL into (filesystem, path inside it).

    An unknown scheme (``foo://``) or one whose package is not installed (``s3://`` without s3fs)
    is bad input, named as such, not a traceback from deep inside fsspec. So is a chained URL
    (`CHAIN`), which fsspec would accept.
    """
    text = str(url)
    if CHAIN in text:
        raise chained_url_error(text)
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


def location_key(url: str) -> str:
    """A location as compared for sameness: local paths resolved (``file:///d``, ``/d/``,
    ``/x/../d``, a relative path and a symlink to ``/d`` are one place), other URLs as written
    but for a trailing slash (an object store has no symlinks to resolve, and asking it would
    cost a request). Used wherever two spellings must be recognised as one place: a held-out
    source that is a training source, a checkpoint inside a run's own ``ckpt/``."""
    url = str(url).removeprefix("file://")
    return url.rstrip("/") if "://" in url else os.path.realpath(url)


CHAIN = "::"
"""fsspec's URL chaining (``simplecache::s3://b/x``, ``dir::file:///data``), refused everywhere.

Not supported, because a chain would be accepted and then misread: the code that takes a
filesystem from here decides by its type and protocol (local → rename and flock; an object store
→ one PUT per file, no append) and names what it lists with ``fs.unstrip_protocol``, which
drops the chain (``simplecache::file:///x`` lists as ``file:///x``, ``dir::...`` as an
unresolvable ``dir://...``); a cache layer would also serve a run's growing metrics.jsonl stale.
Measured before the refusal: ``data prepare 'dir::file:///d'`` said "input not found",
``--out 'simplecache::file:///d'`` "written to a local folder", ``train --run-dir 'dir::...'``
ran as if remote (no TensorBoard; metrics as one object per record, not flock-ed appends), and
a local name with ``::`` silently lost everything from ``::`` on. fsspec splits on ``::``
anywhere, so a URL holding one has no other meaning to give it."""


def chained_url_error(text: str) -> MscaleError:
    return MscaleError("chained fsspec URLs ('::') are not supported; fsspec reads '::' "
                       "anywhere in a URL as a chain, an IPv6 address's included", file=text,
                       fix="name the storage itself, without PROTOCOL:: in front (a local path, "
                           "file:///data, s3://bucket/data, a host name instead of an IPv6 "
                           "address); to cache remote data, copy it to a local folder first; a "
                           "local name with '::' in it must be renamed")
