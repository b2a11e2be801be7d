"""The checkpoint switches of one training run, declared once.

`mscale.train.options.TrainOptions` embeds a `CkptOptions` (field ``ckpt``), `mscale train`
derives its --ckpt-*/--resume/--zstd-level flags from these fields, the launcher hands it to every
worker inside the serialised TrainOptions, and the `Checkpointer` reads it as is: a new checkpoint
option is a field here, nothing else.
"""

from __future__ import annotations

from pydantic import Field

from mscale.ckpt.limits import DEFAULT_CHUNK_BYTES, MAX_LEVEL, MIN_LEVEL  # torch-free
from mscale.config.base import NOT_A_FLAG, StrictModel, flag


class CkptOptions(StrictModel):
    """Checkpoint switches of one training run."""

    interval: int | None = Field(None, ge=1, json_schema_extra=flag("--ckpt-interval"))
    """Steps between checkpoints (default: training.checkpoint_interval, else the plan's
    advice). Saves also happen on request, before a halt and at the end."""
    keep: int = Field(3, ge=1, json_schema_extra=flag("--ckpt-keep"))
    """Committed checkpoints to keep (the newest is never deleted)."""
    level: int = Field(1, ge=MIN_LEVEL, le=MAX_LEVEL, json_schema_extra=flag("--zstd-level"))
    """zstd level of checkpoint chunks; 0 = uncompressed."""
    final: bool = Field(True, json_schema_extra=flag("--final-ckpt", negative="--no-final-ckpt"))
    """Save a checkpoint after the last step."""
    resume: str = Field("auto", json_schema_extra=flag("--resume"))
    """auto: continue from RUN_DIR/ckpt/latest if any (without it, the newest committed
    checkpoint); none: start fresh; or a checkpoint/run directory (another run's only starts
    this one: docs/ckpt.md)."""
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=1, json_schema_extra=NOT_A_FLAG)
    """Bytes per chunk of a shard file (each compressed and checksummed on its own)."""

    @property
    def codec(self) -> str:
        return "zstd" if self.level else "raw"

    def interval_for(self, plan) -> int | None:
        """The interval in force for ``plan``: this option, the plan's training setting, or the
        planner's advice recorded in the plan."""
        if self.interval:
            return self.interval
        if plan.training.checkpoint_interval:
            return plan.training.checkpoint_interval
        return plan.checkpoint.interval_steps if plan.checkpoint else None
