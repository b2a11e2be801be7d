"""Decoding the small metadata files of a checkpoint, which anyone with write access may have made.

A checkpoint directory is input like any other: ``manifest.json``, ``COMMITTED`` and ``latest``
can be truncated, binary, UTF-16, absurdly large or nested 200,000 deep, and a checksum proves
nothing when whoever changed the manifest also re-signed it. The JSON files go through
`load_json`: config's one hardened reader (`mscale.config.json_reader.parse_json`: size, UTF-8,
nesting and numbers bounded before parsing) with a checkpoint's exit code (2, damaged) and fix;
`text` decodes the ``latest`` pointer. What comes out is plain data for the schemas in
manifest.py to check field by field.
"""

from __future__ import annotations

from typing import Any

from mscale.config.json_reader import parse_json
from mscale.errors import EXIT_CRITICAL, MscaleError

DAMAGED = "the checkpoint is damaged or was altered; use an older one (mscale ckpt ls)"


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


def load_json(data: bytes, source: str, what: str, max_bytes: int) -> Any:
    """A checkpoint's JSON file (manifest, commit marker): `parse_json`'s bounds, and every
    failure a damaged checkpoint (exit 2) naming ``source``."""
    return parse_json(data, source, what=what, max_bytes=max_bytes, code=EXIT_CRITICAL,
                      fix=DAMAGED)
