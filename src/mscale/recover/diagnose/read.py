"""Bounded, forgiving reads of a failed run's files, for `mscale.recover.diagnose.evidence`.

A diagnosis runs after something went wrong, often on a huge or damaged run directory: a log of
many gigabytes, a half-written JSON file, a pickled dump. So every read here is capped (the
*tail* of a log, since the end says how it ended), decodes UTF-8 with replacement, parses JSON
only (never pickle, never YAML here), and reports a problem instead of raising: a damaged file is
evidence, not a crash of recover. Paths are local paths or fsspec URLs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mscale.runs.atomic import fs_and_path

LOG_TAIL_BYTES = 256 * 1024
"""Bytes read from the end of one log: enough for the last traceback and the lines before it."""
JSON_CAP_BYTES = 4 * 1024 * 1024
"""Largest JSON document read whole (error files, preflight.json, quarantine.json)."""
JSONL_TAIL_BYTES = 32 * 1024 * 1024
"""Bytes read from the end of events.jsonl (a multi-week run's events fit many times over)."""
METRICS_TAIL_BYTES = 4 * 1024 * 1024
"""Bytes read from the end of metrics.jsonl: only the last records matter (one record of a
12,288-rank run is ~1.9 MB with plain vectors, so the tail holds about two; ~190 KB in the compact
form `train` writes from 1,024 ranks on: docs/benchmarks.md, "watch")."""
FLIGHT_CAP_BYTES = 64 * 1024 * 1024
"""Largest flight-recorder JSON dump read."""
MAX_FILES = 100_000
"""Files listed under logs/ at most (a run of 12,288 ranks has ~25,000)."""
MAX_SEGMENTS = 10_000
"""Newest object-store JSONL segments read at most (one record each)."""


@dataclass
class FileInfo:
    """A file found in the run directory, before reading it."""

    url: str
    """Full path or URL."""
    source: str
    """Path relative to the run directory (what evidence lines cite)."""
    size: int
    """Bytes."""
    mtime: float | None
    """Modification time (Unix), None where the filesystem does not say."""


class Problem(Exception):
    """A file that exists but cannot be used; its message is one line of evidence."""


class Missing(Problem):
    """A file that is not there: for a record file no one has written yet (a run that stopped
    before its first step has no metrics.jsonl), nothing to report."""


def _mtime(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


def stat(url: str, source: str) -> FileInfo | None:
    """The file's size and time, or None when it does not exist."""
    try:
        fs, path = fs_and_path(url)
        info = fs.info(path)
    except (FileNotFoundError, OSError):
        return None
    if info.get("type") not in (None, "file"):
        return None
    return FileInfo(url, source, int(info.get("size") or 0), _mtime(info))


def listing(root: str, sub: str, maxdepth: int = 6) -> list[FileInfo]:
    """Files under ``root/sub`` (at most `MAX_FILES`, ``maxdepth`` levels), sorted by path."""
    try:
        fs, base = fs_and_path(root.rstrip("/") + ("/" + sub if sub else ""))
        if not fs.isdir(base):
            return []
        found = fs.find(base, maxdepth=maxdepth, detail=True)
    except (OSError, ValueError):
        return []
    out = []
    prefix = root.rstrip("/")
    for path, info in sorted(found.items())[:MAX_FILES]:
        if info.get("type") != "file":
            continue
        rel = path[len(base):].lstrip("/")
        source = f"{sub}/{rel}" if sub else rel
        out.append(FileInfo(f"{prefix}/{source}", source, int(info.get("size") or 0),
                            _mtime(info)))
    return out


def read_tail(url: str, limit: int = LOG_TAIL_BYTES,
              size: int | None = None) -> tuple[str, bool]:
    """The last ``limit`` bytes of a file as text, and whether it was cut (then the first,
    partial line is dropped). ``size``: known from a listing (a request fewer). Raises `Problem`
    when it cannot be read."""
    try:
        fs, path = fs_and_path(url)
        if size is None:
            size = int(fs.info(path).get("size") or 0)
        with fs.open(path, "rb") as f:
            if size > limit:
                f.seek(size - limit)
            raw = f.read(limit)
    except FileNotFoundError as e:
        raise Missing(f"missing: {e}") from None
    except (OSError, ValueError) as e:
        raise Problem(f"unreadable: {type(e).__name__}: {e}") from None
    text = raw.decode("utf-8", errors="replace")
    cut = size > limit
    if cut:
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text, cut


def read_head(url: str, n: int = 64) -> bytes:
    """The first ``n`` bytes (to tell JSON from a pickle without reading either)."""
    try:
        fs, path = fs_and_path(url)
        with fs.open(path, "rb") as f:
            return f.read(n)
    except (OSError, ValueError) as e:
        raise Problem(f"unreadable: {type(e).__name__}: {e}") from None


def read_json(info: FileInfo, cap: int = JSON_CAP_BYTES) -> object:
    """A JSON document read whole, refused past ``cap`` bytes. Raises `Problem`."""
    if info.size > cap:
        raise Problem(f"{info.size} bytes, over the {cap}-byte cap: not read")
    text, _ = read_tail(info.url, cap + 1, info.size)
    try:
        return json.loads(text)
    except ValueError as e:
        raise Problem(f"not valid JSON ({e})") from None
    except RecursionError:  # a few hundred KB of nested brackets, well under any cap
        raise Problem("not valid JSON (nested too deeply to read)") from None


def read_jsonl_tail(url: str, limit: int) -> tuple[list[dict], list[str]]:
    """Records of a JSONL file from its last ``limit`` bytes, with the problems met (bad lines
    are skipped and counted, never fatal). Object-store appends (``<file>.d/`` segments,
    `mscale.runs.atomic`) are read after the base file, newest last, within the same budget."""
    problems: list[str] = []
    segments = _segments(url)
    if len(segments) > MAX_SEGMENTS:
        problems.append(f"only the newest {MAX_SEGMENTS} of {len(segments)} appended records "
                        "were read")
        segments = segments[-MAX_SEGMENTS:]
    parts = [url] + segments
    budget = limit
    texts: list[str] = []
    for part in reversed(parts):  # newest last: spend the budget from the end
        if budget <= 0:
            problems.append("older records past the read limit were not read")
            break
        try:
            text, cut = read_tail(part, budget)
        except Missing:  # not written yet: no records, nothing wrong
            continue
        except Problem as e:  # the other parts may still say how the run ended
            problems.append(f"{part.rsplit('/', 1)[-1]}: {e}")
            continue
        budget -= len(text.encode())
        texts.append(text)
        if cut:
            problems.append("older records past the read limit were not read")
            break
    records, bad = _records("".join(f"{t}\n" for t in reversed(texts)))
    if bad:
        problems.append(f"{bad} line(s) are not JSON records and were skipped")
    return records, problems


def _records(text: str) -> tuple[list[dict], int]:
    """The JSON objects of a JSONL text, and how many lines were not one."""
    records: list[dict] = []
    bad = 0
    for line in text.split("\n"):  # not splitlines: see runs/atomic.py `_parse`
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def _segments(url: str) -> list[str]:
    """Appended segments of an object-store JSONL file, oldest first (the base file's order)."""
    try:
        fs, path = fs_and_path(url + ".d")
        if not fs.isdir(path):
            return []
        names = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".jsonl"))
    except (OSError, ValueError):
        return []
    return [f"{url}.d/{n.rsplit('/', 1)[-1]}" for n in names]
