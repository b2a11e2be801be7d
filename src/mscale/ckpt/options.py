"""The checkpoint switches of one training run, declared once.

`mscale.train.options.TrainOptions` embeds a `CkptOptions` (field ``ckpt``), the launcher hands
it to every worker inside the serialised TrainOptions, and the `Checkpointer` reads it as is: a new
checkpoint option is a field here plus its CLI flag, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from mscale.ckpt.format import DEFAULT_CHUNK_BYTES


@dataclass
class CkptOptions:
    """Checkpoint switches of one training run (`mscale train`'s --ckpt-* flags and --resume)."""

    interval: int | None = None
    """Steps between saves; None: training.checkpoint_interval, else the plan's advice
    (`interval_for`). Saves also happen on request, before a halt and at the end."""
    keep: int = 3
    """Committed checkpoints kept (the newest is never deleted)."""
    level: int = 1
    """zstd level of the chunks; 0 stores them raw."""
    final: bool = True
    """Save when training finishes."""
    resume: str = "auto"
    """``auto``: continue from RUN_DIR/ckpt/latest if there is one; ``none``: start fresh; or a
    checkpoint / run directory to start from (docs/ckpt.md)."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk of a shard file (each compressed and checksummed on its own)."""
    chunk_delay_s: float = 0.0
    """Test hook: the writer sleeps this long after each chunk (a slow filesystem)."""
    copy_delay_s: float = 0.0
    """Test hook: the writer sleeps this long before the host copy (a slow copy)."""

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
