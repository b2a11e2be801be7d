"""The run directory: the contract between subcommands.

Subcommands never talk to each other; they read and write these files. Paths are strings so that
any fsspec URL (``memory://``, ``s3://``) works as well as a local directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import BaseModel

from mscale.runs.atomic import append_line, fs_and_path

RUN_DIR_MARKS = ("events.jsonl", "plan.yaml", "ckpt", "logs")
"""What a training run leaves in its directory; one of them makes a directory look like one."""


def looks_like_run_dir(path: str) -> bool:
    """A local directory holding what a run directory holds (`RUN_DIR_MARKS`): how ``mscale
    recover`` tells a run directory called ``supervise`` from its subcommand. Local only: a
    command word is never probed on a remote filesystem."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, name))
                                       for name in RUN_DIR_MARKS)


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @property
    def plan(self) -> str:
        return self.path("plan.yaml")

    @property
    def preflight(self) -> str:
        return self.path("preflight.json")

    @property
    def metrics(self) -> str:
        return self.path("metrics.jsonl")

    @property
    def events(self) -> str:
        return self.path("events.jsonl")

    @property
    def lock(self) -> str:
        """Who owns the directory now (`mscale.runs.lock.RunLock`)."""
        return self.path("lock.json")

    @property
    def plans(self) -> str:
        """Every plan the run has trained with, oldest first (`mscale.runs.history`)."""
        return self.path("plans")

    @property
    def control(self) -> str:
        return self.path("control")

    @property
    def trace(self) -> str:
        """Timelines of sampled steps, ``step-NNNNNN.json`` (Chrome trace-event format)."""
        return self.path("trace")

    @property
    def quarantine(self) -> str:
        return self.path("quarantine.json")

    @property
    def data_skip(self) -> str:
        """Data windows skipped on rollbacks (`mscale.config.records.DataSkips`), read by train."""
        return self.path("data_skip.json")

    @property
    def recover(self) -> str:
        """`mscale recover`'s decisions, one JSON document per recovery, and supervise's state."""
        return self.path("recover")

    @property
    def ckpt(self) -> str:
        return self.path("ckpt")

    @property
    def logs(self) -> str:
        return self.path("logs")

    def create(self) -> None:
        """Make the directory and its fixed subdirectories."""
        fs, root = fs_and_path(self.root)
        for sub in ("", "control", "ckpt", "logs"):
            fs.makedirs(f"{root}/{sub}".rstrip("/"), exist_ok=True)

    def append_record(self, url: str, record: BaseModel) -> None:
        """Append one schema record as a JSON line (metrics, events): the whole line or nothing;
        a full disk raises `mscale.runs.atomic.DiskFullError` (an MscaleError, exit 3)."""
        append_line(url, record.model_dump_json(exclude_none=True))
