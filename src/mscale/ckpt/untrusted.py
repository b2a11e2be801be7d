"""Decoding the small metadata files of a checkpoint, which anyone with write access may have made.

A checkpoint directory is input like any other: ``manifest.json``, ``COMMITTED`` and ``latest``
can be truncated, binary, UTF-16, absurdly large or nested 200,000 deep, and a checksum proves
nothing when whoever changed the manifest also re-signed it. Python's ``json`` module recurses
once per nesting level (a RecursionError), turns ``1e999`` into infinity, accepts ``NaN`` and
parses integers of thousands of digits, so every such file is bounded here *before* it is parsed:
its size, its encoding (UTF-8 only: mscale writes nothing else), its nesting depth, its numbers.
What comes out is plain JSON data for the schemas in manifest.py to check field by field.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from mscale.ckpt.limits import MAX_DEPTH, MAX_INT_DIGITS
from mscale.errors import EXIT_CRITICAL, MscaleError

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKETS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
DAMAGED = "the checkpoint is damaged or was altered; use an older one (mscale ckpt ls)"


def depth(data: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside strings, without parsing (linear, no recursion)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(_BRACKETS[b] for b in brackets), default=0)


def text(data: bytes, source: str, what: str, fix: str = DAMAGED) -> str:
    """``data`` as UTF-8 text, or an error naming the file (binary, UTF-16, ...)."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise MscaleError(f"{what} holds a NUL byte at offset {nul}: binary or UTF-16, not the "
                          "UTF-8 text mscale writes", file=source, code=EXIT_CRITICAL, fix=fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MscaleError(f"{what} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}): "
                          "binary or another encoding", file=source, code=EXIT_CRITICAL,
                          fix=fix) from None


def _finite(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s} is out of range")
    return v


def _bounded_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(s)} digits")
    return int(s)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(data: bytes, source: str, what: str, max_bytes: int, code: int = EXIT_CRITICAL,
              fix: str = DAMAGED) -> Any:
    """Parse untrusted JSON bytes: bounded size and depth, UTF-8, finite numbers, 64-bit ints.
    Every failure is an MscaleError naming ``source``; ``code`` 2 (the default) says a
    checkpoint is damaged, 3 that an input (an HF config.json) is bad."""
    if len(data) > max_bytes:
        raise MscaleError(f"{what} is {len(data)} bytes, more than the {max_bytes} allowed",
                          file=source, code=code, fix=fix)
    try:
        decoded = text(data, source, what, fix)
    except MscaleError as e:
        e.code = code
        raise
    nesting = depth(data)
    if nesting > MAX_DEPTH:
        raise MscaleError(f"{what} nests {nesting} levels deep (at most {MAX_DEPTH})",
                          file=source, code=code, fix=fix)
    try:
        return json.loads(decoded, parse_float=_finite, parse_int=_bounded_int,
                          parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError is one
        raise MscaleError(f"{what} is not valid JSON: {e}", file=source, code=code,
                          fix=fix) from None
