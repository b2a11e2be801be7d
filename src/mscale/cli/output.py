"""Printing helpers shared by commands: one JSON document with --json, rich text otherwise.

Colour only when stdout is a terminal, so logs and CI output stay plain. Errors go through
`print_error`, so every command reports them the same way: one JSON document on stdout with
``--json``, ``error: FILE: FIELD: MESSAGE`` and a ``fix:`` line on stderr without.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console

from mscale.errors import MscaleError


def _width(stream) -> int | None:
    """Terminals report their width; elsewhere (SLURM logs, CI, pipes) rich would assume 80
    columns and truncate table cells, so use COLUMNS or a width that fits every table."""
    if stream.isatty():
        return None
    return int(os.environ.get("COLUMNS", 160))


console = Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))


def configure_help(stream) -> None:
    """Give typer's help the same width rule as our tables.

    typer renders help with rich, which assumes 80 columns off a terminal and cuts option help
    to ``none|selective|ful…`` in ``mscale plan --help | cat``. Its width is a module setting
    read each time help is printed, so it is set per run for the stream the help goes to.
    """
    from typer import rich_utils

    rich_utils.MAX_WIDTH = _width(stream)


def counted(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``, ``12,288 ranks``: a count with its noun in the right number
    (a plain ``s`` plural: every noun the console counts takes one)."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def print_json(obj: Any) -> None:
    """Write one machine-readable document to stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def error_document(e: MscaleError) -> dict:
    """The ``--json`` form of an error: the same five facts the text form shows."""
    return {"error": {"code": e.code, "file": e.file, "field": e.field, "message": e.message,
                      "fix": e.fix}}


def print_error(e: MscaleError, as_json: bool) -> None:
    """Report an error once: a JSON document on stdout, or the text form on stderr."""
    if as_json:
        print_json(error_document(e))
    else:
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()


def parse_rank_values(values: list[str], flag: str, name: str, bounds: tuple[float, float],
                      example: str, closed: bool = True) -> dict[int, float]:
    """``RANK:NAME`` test-hook options (``--inject-delay 3:0.5``) into {rank: value}, each value
    within ``bounds`` (the upper one excluded unless ``closed``); one error naming the flag."""
    lo, hi = bounds
    out: dict[int, float] = {}
    for v in values:
        try:
            rank, value = v.split(":")
            out[int(rank)] = float(value)
        except ValueError:
            raise MscaleError(f"{v!r} is not RANK:{name}", field=flag,
                              fix=f"e.g. {flag} {example}") from None
        x = out[int(rank)]
        if not (lo <= x <= hi if closed else lo <= x < hi):
            shown = f"[{lo:g}, {hi:g}]" if closed else f"[{lo:g}, {hi:g})"
            raise MscaleError(f"{v!r}: {name} must be in {shown}", field=flag,
                              fix=f"e.g. {flag} {example}")
    return out
