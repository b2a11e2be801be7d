"""Read a JSONL file as it grows: only what was appended since the last read.

`JsonlTail.read` costs O(new records), not O(file), however big the file is:

- a local file, or a remote one that supports range reads, is read from a byte offset; only
  whole lines are consumed, so a torn last line (the writer is mid-append, or died there) waits
  for the next read. A tail without its newline that is already a whole JSON object is taken (a
  strict prefix of a JSON object never parses), so a file that simply lacks a final newline loses
  nothing;
- on object stores the writer puts one object per record under ``<file>.d/``
  (`mscale.runs.atomic`); their names sort in append order, so the tail keeps the last name it
  read and fetches only names after it. Listings and sizes are re-read every time (fsspec caches
  them otherwise and would never see a new record);
- a file that is briefly missing (being replaced, a flaky mount) is not an error: the read
  returns nothing and the next one carries on;
- a file that shrank, changed inode, or whose first bytes changed was replaced: the tail starts
  it over and says so.

`watch` follows ``metrics.jsonl`` (stream.py `MetricsFeed`, which adds the job's attempts) and
``events.jsonl`` (follow.py `EventFeed`) with it.
"""

from __future__ import annotations

import json
from typing import Any

from mscale.errors import MscaleError
from mscale.runs.atomic import SEGMENTS, fs_and_path

HEAD_BYTES = 256
"""Bytes at the start of the file remembered to recognise it: a metrics file's first record's
``time`` lies within them, so a replaced file differs even when it has grown past the old
offset."""


class JsonlTail:
    """The records appended to one JSONL file (and its object-store segments) since the last
    `read` (module docstring)."""

    def __init__(self, url: str, max_bytes: int = 8 << 20):
        self.url = url
        self.fs, self.path = fs_and_path(url)
        self.max_bytes = max_bytes
        """Roughly how much one read takes; the rest waits (see ``caught_up``)."""
        self.caught_up = True
        """The last read took everything there was; False: read again before sleeping."""
        self.found = False
        """The file (or its segments) existed at the last read."""
        self._offset, self._ino, self._head, self._lines = 0, None, b"", 0
        self._seg_first: str | None = None
        self._seg_last = ""

    def read(self) -> tuple[list[dict], bool]:
        """New records of the base file, then of the segment objects; and whether either was
        replaced since the last read."""
        self.caught_up, self.found = True, False
        base, replaced = self._read_base()
        segments, replaced_segments = self._read_segments()
        return base + segments, replaced or replaced_segments

    def _read_base(self) -> tuple[list[dict], bool]:
        self.fs.invalidate_cache(self.path)
        try:
            info = self.fs.info(self.path)
        except FileNotFoundError:
            return [], False  # briefly missing, or an object store that only has segments
        if info.get("type") != "file":
            return [], False
        self.found = True
        size, ino = int(info["size"]), info.get("ino")
        replaced = self._replaced(size, ino)
        if replaced:
            self._offset, self._head, self._lines = 0, b"", 0
        self._ino = ino
        if size <= self._offset:
            return [], replaced
        records = self._consume(size)
        if len(self._head) < min(HEAD_BYTES, self._offset):
            self._head = self.fs.cat_file(self.path, start=0, end=min(HEAD_BYTES, self._offset))
        return records, replaced

    def _replaced(self, size: int, ino: Any) -> bool:
        """A different file than the one read so far: new inode, shorter, other first bytes."""
        if self._offset == 0:
            return False
        if (ino is not None and self._ino is not None and ino != self._ino) or size < self._offset:
            return True
        head = self.fs.cat_file(self.path, start=0, end=len(self._head)) if self._head else b""
        return head != self._head

    def _consume(self, size: int) -> list[dict]:
        """Read from the offset: whole lines, at most about ``max_bytes`` of them."""
        end = min(size, self._offset + self.max_bytes)
        data = self.fs.cat_file(self.path, start=self._offset, end=end)
        while b"\n" not in data and end < size:  # one line longer than max_bytes
            more = self.fs.cat_file(self.path, start=end, end=min(size, end + self.max_bytes))
            if not more:
                break
            data, end = data + more, end + len(more)
        cut = data.rfind(b"\n") + 1
        records = self._parse(data[:cut])
        tail = data[cut:]
        if end >= size and tail.strip():
            last = _whole_object(tail)
            if last is not None:  # a complete record that lacks only its newline
                records.append(last)
                cut = len(data)
        self.caught_up = self.caught_up and end >= size
        self._offset += cut
        return records

    def _parse(self, body: bytes) -> list[dict]:
        out = []
        for line in body.split(b"\n"):
            self._lines += 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if not isinstance(rec, dict):
                raise MscaleError(f"line {self._lines} is not a JSON object", file=self.url,
                                  fix="the file is corrupt; move the bad line away")
            out.append(rec)
        self._lines -= 1  # the text after the last newline is not a line yet
        return out

    def _read_segments(self) -> tuple[list[dict], bool]:
        """New ``<file>.d/`` objects (object stores: one record each), in name order."""
        folder = self.path + SEGMENTS
        self.fs.invalidate_cache(folder)
        try:
            listing = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return [], False
        sizes = {e["name"].rsplit("/", 1)[-1]: (e["name"], e.get("size") or 0) for e in listing
                 if e.get("type") == "file" and e["name"].endswith(".jsonl")}
        names = sorted(sizes)
        if not names:
            return [], False
        self.found = True
        replaced = self._seg_first is not None and self._seg_first not in sizes
        if replaced or self._seg_first is None:
            self._seg_first, self._seg_last = names[0], "" if replaced else self._seg_last
        new, budget = [], self.max_bytes
        for name in names:
            if name > self._seg_last and (not new or budget > 0):
                new.append(name)
                budget -= sizes[name][1]
        self.caught_up = self.caught_up and (not new or new[-1] == names[-1])
        if not new:
            return [], replaced
        paths = [sizes[n][0] for n in new]
        blobs = self.fs.cat(paths)
        records = []
        for name, path in zip(new, paths):
            raw = blobs[path] if path in blobs else self.fs.cat_file(path)
            for line in raw.split(b"\n"):
                if line.strip():
                    rec = _whole_object(line)
                    if rec is None:
                        raise MscaleError("a segment is not a JSON object",
                                          file=f"{self.url}{SEGMENTS}/{name}",
                                          fix="the object is corrupt; move it away")
                    records.append(rec)
        self._seg_last = new[-1]
        return records, replaced


def _whole_object(raw: bytes) -> dict | None:
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None
