"""What every rank of a preflight job needs, declared once: each field that is a flag of
`mscale preflight` says so (`config.base.flag`), and the CLI derives the option and its help
from it (cli/options.py). Torch-free: the ``--local`` launcher builds it, and a launcher that
imported torch would spend seconds before starting a worker."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mscale.config.base import NOT_A_FLAG, StrictModel, flag

Level = Literal["quick", "full"]
"""How long preflight measures: ``quick`` (sized to end within about a minute at any scale;
6 s for 8 processes on 2 CPU cores) or ``full``; the CLI's choices."""

OPTIONS_ENV = "MSCALE_PREFLIGHT_OPTIONS"
"""Where the ``--local`` launcher hands each worker the options, serialised once."""


class PreflightOptions(StrictModel):
    """What every rank needs; the ``--local`` launcher hands the same options to each worker."""

    run_dir: str = Field(json_schema_extra=NOT_A_FLAG)
    """Run directory (path or fsspec URL); preflight.json is written there."""
    plan_path: str | None = Field(None, json_schema_extra=NOT_A_FLAG)
    """The plan file, as given (named in errors)."""
    level: Level = Field("quick", json_schema_extra=flag("--level", choices=("quick", "full")))
    """quick (within about a minute at any scale; 8 CPU processes on 2 cores: 6 s idle, 10-30 s
    beside other work) or full (longer transfers, more repetitions)."""
    timeout_s: float = Field(120.0, ge=1.0, json_schema_extra=flag("--timeout"))
    """Seconds before a hung collective names the ranks that did not answer."""
    as_json: bool = Field(False, json_schema_extra=flag("--json"))
    """Print the report as JSON on stdout."""
    prometheus: str | None = Field(None, json_schema_extra=flag("--prometheus"))
    """Also write a Prometheus textfile."""
    sysfs_root: str = Field("/sys", json_schema_extra=flag("--sysfs-root"))
    """Where to read InfiniBand ports from (a fixture tree in tests)."""
    storage_url: str | None = Field(None, json_schema_extra=flag("--storage-url"))
    """Checkpoint storage to test (default: the run directory's ckpt/)."""
    inject_slow: dict[int, float] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-slow", hidden=True, metavar="RANK:FACTOR", bounds=(1.0, 1e6), example="5:4"))
    """Test hook: that rank's timed GEMM, sends, receives and collectives take FACTOR times as
    long."""


def options_from_env() -> PreflightOptions | None:
    """The options a ``--local`` launcher handed this worker, if it started it."""
    import os

    raw = os.environ.get(OPTIONS_ENV)
    return PreflightOptions.model_validate_json(raw) if raw else None
