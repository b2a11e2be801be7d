"""Run-time options of one training process that are not part of the plan."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainOptions:
    """Switches from the command line; the plan holds everything about the model and layout."""

    run_dir: str
    """Run directory (local path or fsspec URL)."""
    steps: int | None = None
    """Override training.steps (e.g. a short smoke test)."""
    inject_delay: dict[int, float] = field(default_factory=dict)
    """Test hook: global rank → seconds of extra compute per step, to emulate a straggler."""
    inject_nan_step: int | None = None
    """Test hook: poison the loss with NaN at this (1-based) step, to exercise the NaN stop."""
    gc_interval: int = 50
    """Steps between synchronized garbage collections (automatic GC is off)."""
    log_interval: int = 1
    """Steps between progress lines when stdout is not a terminal."""
    progress: bool = True
    """Show a progress bar / progress lines on rank 0."""
    timeout_s: float = 120.0
    """Timeout of every collective; a hung peer fails the job after this long."""
    resume: str = "auto"
    """``auto``: continue from RUN_DIR/ckpt/latest if there is one; ``none``: start fresh; or a
    checkpoint / run directory to start from (docs/ckpt.md)."""
    ckpt_interval: int | None = None
    """Steps between checkpoints; None: training.checkpoint_interval, else the plan's advice."""
    ckpt_keep: int = 3
    """Committed checkpoints to keep (the newest is never deleted)."""
    ckpt_level: int = 1
    """zstd level of checkpoint chunks; 0 writes them uncompressed."""
    ckpt_final: bool = True
    """Save a checkpoint when the last step is done."""
    json_summary: bool = False
    """Rank 0 prints one JSON document with the closing figures on stdout, its console lines on
    stderr (``mscale train --json`` under srun/torchrun; with --local the launcher does it)."""
    inject_ckpt_delay: float = 0.0
    """Test hook: seconds the checkpoint writer sleeps after each chunk (a slow filesystem)."""

    def checkpoint_interval(self, plan) -> int | None:
        """The interval in force: this option, the plan's training setting, or its advice."""
        if self.ckpt_interval:
            return self.ckpt_interval
        if plan.training.checkpoint_interval:
            return plan.training.checkpoint_interval
        return plan.checkpoint.interval_steps if plan.checkpoint else None
