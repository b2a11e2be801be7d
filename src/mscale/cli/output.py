"""Printing helpers shared by commands: one JSON document with --json, rich text otherwise.

Colour only when stdout is a terminal, so logs and CI output stay plain.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console


def _width(stream) -> int | None:
    """Terminals report their width; elsewhere (SLURM logs, CI, pipes) rich would assume 80
    columns and truncate table cells, so use COLUMNS or a width that fits every table."""
    if stream.isatty():
        return None
    return int(os.environ.get("COLUMNS", 160))


console = Console(highlight=False, soft_wrap=False, width=_width(sys.stdout))


def print_json(obj: Any) -> None:
    """Write one machine-readable document to stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()
