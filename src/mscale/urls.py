"""Local paths and fsspec URLs: the one place a location string becomes a filesystem.

A leaf module (it imports only fsspec and errors) so that every layer — config reading a plan,
runs writing records, ckpt reading shards — resolves locations the same way, and an unknown
protocol is the same clean error everywhere.
"""

from __future__ import annotations

import fsspec

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
