"""What every rank of a preflight job needs, declared once (torch-free: the ``--local`` launcher
builds it, and a launcher that imported torch would spend seconds before starting a worker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Level = Literal["quick", "full"]
"""How long preflight measures: ``quick`` (about a minute) or ``full``; the CLI's choices."""


@dataclass
class PreflightOptions:
    """What every rank needs; the ``--local`` launcher passes the same flags to each worker."""

    run_dir: str
    level: Level = "quick"
    timeout_s: float = 120.0
    inject_slow: dict[int, float] = field(default_factory=dict)
    sysfs_root: str = "/sys"
    storage_url: str | None = None
    plan_path: str | None = None
    as_json: bool = False
    prometheus: str | None = None
