"""The checkpoint switches of one training run, declared once.

`mscale.train.options.TrainOptions` embeds a `CkptOptions` (field ``ckpt``), the launcher hands
it to every worker inside the serialised TrainOptions, and the `Checkpointer` reads it as is: a new
checkpoint option is a field here plus its CLI flag, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mscale.ckpt.limits import DEFAULT_CHUNK_BYTES  # not format: the launcher stays torch-free


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
    inject_enospc_step: int | None = None
    """Test hook: the save of this step fails on every rank with a real ``OSError(ENOSPC)``
    from the writer, after its first chunk is written (a full checkpoint filesystem)."""
    inject_kill: dict[int, int] = field(default_factory=dict)
    """Test hook: rank → step whose save that rank's writer interrupts by SIGKILLing the
    process after the first chunk is written (a crash in the middle of a checkpoint)."""
    inject_hang: dict[int, int] = field(default_factory=dict)
    """Test hook: as ``inject_kill`` with SIGSTOP (a rank hung in the middle of a save)."""

    def __post_init__(self) -> None:
        self.inject_kill = {int(k): int(v) for k, v in self.inject_kill.items()}  # JSON's keys
        self.inject_hang = {int(k): int(v) for k, v in self.inject_hang.items()}

    def write_fault(self, rank: int, step: int) -> str | None:
        """The injected fault of ``rank``'s write of the save of ``step``, if any."""
        if self.inject_kill.get(rank) == step:
            return "kill"
        if self.inject_hang.get(rank) == step:
            return "hang"
        return "enospc" if self.inject_enospc_step == step else None

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
