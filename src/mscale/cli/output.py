"""Printing helpers shared by commands: one JSON document with --json, rich text otherwise.

Colour only when stdout is a terminal, so logs and CI output stay plain.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

console = Console(highlight=False, soft_wrap=False)
err_console = Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    """Write one machine-readable document to stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()
