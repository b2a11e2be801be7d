"""mscale.urls.fs_and_path: local paths and fsspec URLs resolve; unknown protocols and chained
URLs (``::``) are one clean MscaleError, never a misread (fsspec would take a chain, and a local
name with ``::`` would lose everything after it); location_key makes one place of a location's
spellings."""

from __future__ import annotations

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.urls import fs_and_path, location_key


def test_paths_and_urls_resolve(tmp_path):
    fs, path = fs_and_path(str(tmp_path))
    assert isinstance(fs, LocalFileSystem) and path == str(tmp_path)
    fs, path = fs_and_path(f"file://{tmp_path}")
    assert isinstance(fs, LocalFileSystem) and path == str(tmp_path)
    fs, path = fs_and_path("memory://bucket/x")
    assert isinstance(fs, MemoryFileSystem) and path == "/bucket/x"


@pytest.mark.parametrize("url", [
    "dir::file:///data",
    "simplecache::memory://bucket/x",
    "simplecache::s3://bucket/x",  # refused before fsspec would ask for s3fs
    "zip://a.txt::file:///data/f.zip",
    "memory://a::b",
    "/data/a::b",  # fsspec would read /data/a
])
def test_chained_urls_are_refused_naming_the_url_and_the_fix(url):
    with pytest.raises(MscaleError, match=r"chained fsspec URLs \('::'\) are not supported") as e:
        fs_and_path(url)
    assert e.value.file == url and e.value.code == EXIT_BAD_INPUT
    assert "file:///data" in e.value.fix and "copy it to a local folder" in e.value.fix


def test_an_unknown_protocol_is_still_named():
    with pytest.raises(MscaleError, match="unknown storage protocol 'nope'"):
        fs_and_path("nope://x")


def test_location_key_makes_one_place_of_its_spellings(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    spellings = [str(d), f"{d}/", f"file://{d}", str(tmp_path / "x" / ".." / "d"),
                 str(tmp_path / "link")]
    assert {location_key(s) for s in spellings} == {str(d.resolve())}
    # a URL is taken as written but for a trailing slash: no request to an object store
    assert location_key("s3://b/d/") == location_key("s3://b/d") == "s3://b/d"
    assert location_key("s3://b/d") != location_key("s3://b/D")
