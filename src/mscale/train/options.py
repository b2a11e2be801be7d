"""Run-time options of one training process that are not part of the plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from mscale.ckpt.options import CkptOptions


@dataclass
class TrainOptions:
    """Switches from the command line; the plan holds everything about the model and layout.

    The launcher serialises this whole object for its workers (`dataclasses.asdict` to JSON and
    back), so an option exists once here, plus its CLI flag. Checkpoint switches live in one
    `CkptOptions` (``ckpt``), which the checkpointer reads as is."""

    run_dir: str
    """Run directory (local path or fsspec URL)."""
    steps: int | None = None
    """Override training.steps (e.g. a short smoke test)."""
    inject_delay: dict[int, float] = field(default_factory=dict)
    """Test hook: global rank → seconds of extra compute per step, to emulate a straggler."""
    inject_data_delay: dict[int, float] = field(default_factory=dict)
    """Test hook: global rank → seconds its data loader takes longer per step (a slow reader)."""
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
    json_summary: bool = False
    """Rank 0 prints one JSON document with the closing figures on stdout, its console lines on
    stderr (``mscale train --json`` under srun/torchrun; with --local the launcher does it)."""
    ckpt: CkptOptions = field(default_factory=CkptOptions)
    """Checkpoint switches: interval, retention, zstd level, final save, --resume, test hooks."""

    def __post_init__(self) -> None:
        if isinstance(self.ckpt, dict):  # the launcher's JSON (`dataclasses.asdict`) read back
            self.ckpt = CkptOptions(**self.ckpt)

