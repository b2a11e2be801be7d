"""Follow a run's ``metrics.jsonl`` as it grows, and turn its records into a `Window`.

`MetricsFeed.poll` reads only what was appended since the previous poll (tail.py `JsonlTail`: a
byte offset locally, new segment objects on an object store; torn tails and briefly missing
files wait), so watching a long run costs O(new records), not O(file), however big the file is.

A job that restarts in the same run directory is followed. A file that shrank, changed inode,
or whose first bytes changed was replaced: the feed starts it over. A step number that goes
back is a resumed job rewriting steps after its checkpoint; a record with another number of
ranks is a re-planned job that resumed where the last one stopped (supervise's checkpoint, then
quarantine: no step goes back). Either way ``restarted`` is set on the poll whose records begin
the new attempt (a poll never mixes two attempts), so a watcher can drop a window that belongs
to the previous one.

`records_to_window` decodes records of schema version 1 (JSON lists) and 2 (encoded vectors,
config/vectors.py) into ``[steps, 5, world]`` arrays: one numpy conversion per vector, no Python
loop over ranks, which is what keeps 12,288-rank records above 10 a second on one core
(bench/bench_watch.py).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from mscale.config.records import METRICS_SCHEMA_VERSION
from mscale.config.vectors import decode_vector, is_encoded
from mscale.errors import MscaleError
from mscale.watch.tail import JsonlTail
from mscale.watch.window import LINK_VECTORS, PER_RANK, SCALARS, Window

REQUIRED = ("step", "step_time", "compute_time", "comm_wait", "data_time")
"""What a metrics record must carry; everything else is optional (docs/watch.md)."""
SCHEMA_FIX = "see docs/watch.md#metrics-schema for the fields a metrics record must carry"


def metrics_url(url: str) -> str:
    """A ``.jsonl`` file as given, else a run directory's ``metrics.jsonl``."""
    text = str(url).rstrip("/")
    return text if text.endswith(".jsonl") else f"{text}/metrics.jsonl"


class MetricsFeed:
    """Records appended to one metrics file since the last `poll` (module docstring)."""

    def __init__(self, url: str, max_bytes: int = 8 << 20,
                 clock: Callable[[], float] = time.time):
        self.url = metrics_url(url)
        self.tail = JsonlTail(self.url, max_bytes)
        self.clock = clock
        self.restarted = False
        """The records of the last poll begin a new attempt of the job (module docstring)."""
        self.caught_up = True
        """The last poll read everything there was; False: poll again before sleeping."""
        self.last_record_time: float | None = None
        """When the newest record came: its own ``time`` on the first read (a file found already
        silent is judged by when it was written, so ``watch --once`` sees a hang), the wall time
        (``clock``) it was read at after that (no trust in the writer's clock once live)."""
        self._last_step: int | None = None
        self._last_width: int | None = None
        self._held: list[dict] = []
        self._restart_next = False

    def poll(self) -> list[dict]:
        """Complete records appended since the last poll, oldest first."""
        restarted, self._restart_next = self._restart_next, False
        fresh, replaced = self.tail.read()
        if fresh:
            now = self.clock()
            if self.last_record_time is None:
                written = [r["time"] for r in fresh[-1:] if isinstance(r.get("time"), (int, float))
                           and not isinstance(r.get("time"), bool)]
                now = min([now] + written)
            self.last_record_time = now
        if replaced and self._held:  # the held records end the attempt the new file follows
            records, self._held, self._restart_next = self._held, fresh, True
        else:
            records, self._held = self._held + fresh, []
            restarted = restarted or replaced
        records, self.restarted = self._split_attempts(records, restarted)
        self.caught_up = self.tail.caught_up and not self._held
        return records

    @property
    def found(self) -> bool:
        """The file (or its segments) existed at the last poll."""
        return self.tail.found

    def _split_attempts(self, records: list[dict], restarted: bool) -> tuple[list[dict], bool]:
        """Cut at the first step that goes back, or the first record of another world size;
        what follows is held for the next poll."""
        prev = None if restarted else self._last_step
        width = None if restarted else self._last_width
        for i, rec in enumerate(records):
            step = rec.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise MscaleError(f"a record has no integer step (step={step!r})", file=self.url,
                                  field="step", fix=SCHEMA_FIX)
            ranks = _width(rec.get("step_time"))
            if (prev is not None and step <= prev) or (None not in (width, ranks)
                                                       and ranks != width):
                if i:
                    self._held, self._restart_next = records[i:] + self._held, True
                    records = records[:i]
                    break
                restarted = True
            prev, width = step, ranks if ranks is not None else width
        self._last_step, self._last_width = prev, width
        return records, restarted

def records_to_window(records: list[dict], world: int | None = None) -> Window:
    """Records (schema 1 or 2) as a `Window`: ``[n, len(PER_RANK), world]`` per-rank seconds,
    scalars.

    ``world`` defaults to the first record's vector length; a record of another length is an
    error (a new layout is a new attempt: start a new window). A missing ``bubble_time`` is 0, a
    missing link vector (``comm_tp``...), a missing scalar and a vector entry written as null
    are NaN.
    """
    if not records:
        return Window.empty(world or 0)
    if world is None:
        world = len(_vector(records[0], "step_time", None))
    n = len(records)
    ranks = np.zeros((n, len(PER_RANK), world))
    scalars = np.full((n, len(SCALARS)), np.nan)
    steps = np.zeros(n, np.int64)
    extra = []
    for i, rec in enumerate(records):
        _check_record(rec)
        steps[i] = rec["step"]
        for j, name in enumerate(PER_RANK):
            if name == "bubble_time" and rec.get(name) is None:
                continue
            if name in LINK_VECTORS and rec.get(name) is None:
                ranks[i, j] = np.nan
                continue
            ranks[i, j] = _vector(rec, name, world)
        for j, name in enumerate(SCALARS):
            scalars[i, j] = _number(rec, name)
        more = rec.get("extra")
        extra.append(more if isinstance(more, dict) else {})
    return Window(steps=steps, ranks=ranks, scalars=scalars, extra=extra)


def decode_record(rec: dict) -> dict:
    """A copy of a record whose per-rank vectors are plain lists, whatever its version: for
    readers that index ``rec["step_time"][rank]`` as in version 1."""
    out = dict(rec)
    for name in PER_RANK:
        if is_encoded(out.get(name)):
            out[name] = decode_vector(out[name], field=name).tolist()
    return out


def _check_record(rec: dict) -> None:
    version = rec.get("schema_version", 1)
    if not isinstance(version, int) or version > METRICS_SCHEMA_VERSION:
        raise MscaleError(f"metrics schema_version {version!r} is not one this mscale reads "
                          f"(1..{METRICS_SCHEMA_VERSION})", field="schema_version",
                          fix="upgrade mscale, or write a version it reads")
    missing = [k for k in REQUIRED if rec.get(k) is None]
    if missing:
        raise MscaleError(f"the record of step {rec.get('step')!r} lacks {', '.join(missing)}",
                          field=missing[0], fix=SCHEMA_FIX)
    if not isinstance(rec["step"], int) or isinstance(rec["step"], bool):
        raise MscaleError(f"step must be an integer, not {rec['step']!r}", field="step",
                          fix=SCHEMA_FIX)


def _width(value: Any) -> int | None:
    """The number of ranks of a per-rank vector, None when it is not one (`_vector` says why)."""
    if isinstance(value, list):
        return len(value)
    if is_encoded(value):
        try:
            return len(decode_vector(value))
        except MscaleError:
            return None
    return None


def _vector(rec: dict, name: str, world: int | None) -> np.ndarray:
    """One per-rank vector as float64 (null entries NaN); its length must be ``world``."""
    value = rec.get(name)
    if is_encoded(value):
        return decode_vector(value, world, field=name)
    try:
        out = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        out = None
    if out is None or out.ndim != 1:
        raise MscaleError(f"step {rec.get('step')!r}: {name} is not a list of numbers",
                          field=name, fix=SCHEMA_FIX)
    if world is not None and len(out) != world:
        raise MscaleError(f"step {rec.get('step')!r}: {name} has {len(out)} ranks, the job has "
                          f"{world}", field=name,
                          fix="every per-rank vector of a run must have one value per rank")
    return out


def _number(rec: dict, name: str) -> float:
    value = rec.get(name)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MscaleError(f"step {rec.get('step')!r}: {name} must be a number, not {value!r}",
                          field=name, fix=SCHEMA_FIX)
    return float(value)
