"""The one reader of JSON that anyone may have written, bounded before it parses.

Configs (an HF ``config.json``), ``preflight.json``, ``quarantine.json`` and a checkpoint's
manifest, indexes and commit marker all come through `parse_json`: Python's ``json`` alone
recurses once per nesting level, reads ``1e999`` as infinity, accepts ``NaN`` and parses integers
of thousands of digits, so a hostile or damaged file could crash a reader or slip a non-finite
number past a schema.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from mscale.config.files import MAX_CONFIG_BYTES, decode_text
from mscale.errors import EXIT_BAD_INPUT, MscaleError

JSON_MAX_DEPTH = 64
"""Deepest nesting of a JSON document read: a checkpoint manifest nests 7 levels (root, shards,
shard, slices, slice, chunks, chunk), a config or preflight.json a few."""
JSON_MAX_INT_DIGITS = 20
"""Longest JSON integer read: every integer of a manifest or a config fits in 64 bits."""
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_JSON_FIX = "give the JSON file itself, UTF-8, with finite numbers"


def json_depth(data: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside strings, without parsing (linear, no recursion)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(_BRACKETS[b] for b in brackets), default=0)


def parse_json(data: bytes | str, source: str, *, what: str = "file",
               max_bytes: int = MAX_CONFIG_BYTES, code: int = EXIT_BAD_INPUT,
               fix: str | None = None) -> Any:
    """The one reader of JSON that anyone may have written: configs (an HF ``config.json``),
    ``preflight.json`` and a checkpoint's manifest and commit marker alike.

    Python's ``json`` recurses once per nesting level (a RecursionError), turns ``1e999`` into
    infinity, accepts ``NaN`` and parses integers of thousands of digits, so the bytes are
    bounded *before* parsing: at most ``max_bytes``, UTF-8 only (a byte-order mark is dropped;
    UTF-16 and binary are named as such), nesting at most `JSON_MAX_DEPTH`, finite numbers,
    integers of at most `JSON_MAX_INT_DIGITS` digits. Every failure is an MscaleError naming
    ``source`` (a syntax error also its line and column, as the field) with ``code`` (3, bad
    input; a checkpoint reader says 2, damaged) and ``fix`` (default: a config's)."""
    def error(message: str, field: str | None = None, sep: str = " ") -> MscaleError:
        return MscaleError(f"{what}{sep}{message}", file=source, field=field, code=code,
                           fix=fix or _JSON_FIX)

    if len(data) > max_bytes:
        raise error(f"is {len(data):,} bytes, too large: more than the {max_bytes:,} allowed")
    raw = data.encode() if isinstance(data, str) else data
    if isinstance(data, bytes):
        try:
            text = decode_text(data, source)
        except MscaleError as e:
            raise error(e.message, sep=": ") from None
    else:
        text = data
    nesting = json_depth(raw)
    if nesting > JSON_MAX_DEPTH:
        raise error(f"nests {nesting} levels deep (at most {JSON_MAX_DEPTH})")

    def no_constant(name: str) -> Any:
        raise error(f"holds the non-finite number {name}")

    def short_int(digits: str) -> int:
        if len(digits.lstrip("-")) > JSON_MAX_INT_DIGITS:
            raise error(f"holds an integer of {len(digits.lstrip('-'))} digits (at most "
                        f"{JSON_MAX_INT_DIGITS})")
        return int(digits)

    def finite_float(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise error(f"holds the non-finite number {digits} (out of range)")
        return value

    try:
        return json.loads(text, parse_constant=no_constant, parse_int=short_int,
                          parse_float=finite_float)
    except json.JSONDecodeError as e:
        raise error(f"is not valid JSON: {e.msg}",
                    field=f"line {e.lineno}, column {e.colno}") from None
