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
    inject_crash: dict[int, int] = field(default_factory=dict)
    """Test hook: global rank → (1-based) step at which it SIGKILLs itself, mid-step (right
    after its first micro-batch's forward): a crashed process."""
    inject_hang: dict[int, int] = field(default_factory=dict)
    """Test hook: global rank → step at which it SIGSTOPs itself at the same point: a hung
    process that never times out itself. Every inject_* hook (ckpt's included) fires only in
    attempt 1 of a run directory, so a relaunched job trains cleanly (train/faults.py)."""
    gc_interval: int = 50
    """Steps between synchronized garbage collections (automatic GC is off)."""
    log_interval: int = 1
    """Steps between progress lines when stdout is not a terminal."""
    trace_every: int = 0
    """Steps between recorded timelines (``RUN_DIR/trace/step-NNNNNN.json``; 0: only on a
    ``control/trace`` request). A traced step gathers every rank's events to rank 0, so keep it
    rare at scale (train/trace.py)."""
    trace_ranks: str = "replica"
    """Whose events a timeline holds: ``replica`` (DP replica 0's pipeline, pp·tp ranks) or
    ``all``."""
    progress: bool = True
    """Show a progress bar / progress lines on rank 0."""
    timeout_s: float = 120.0
    """Timeout of every collective; a hung peer fails the job after this long."""
    allow_batch_change: bool = False
    """Accept a plan whose global batch differs from the run directory's: the data continues
    from the samples the resumed checkpoint consumed (runs/history.py). `mscale recover` passes
    it when it had to change the batch to fit the remaining nodes."""
    json_summary: bool = False
    """Rank 0 prints one JSON document with the closing figures on stdout, its console lines on
    stderr (``mscale train --json`` under srun/torchrun; with --local the launcher does it)."""
    ckpt: CkptOptions = field(default_factory=CkptOptions)
    """Checkpoint switches: interval, retention, zstd level, final save, --resume, test hooks."""
    launch: dict | None = None
    """How the job was launched, as the user typed it (argv, cwd, absolute plan path, --local N),
    recorded in the ``start`` event for `mscale recover` to relaunch it; set by the CLI (the
    --local launcher's own command line travels to its workers inside these options)."""

    def __post_init__(self) -> None:
        if isinstance(self.ckpt, dict):  # the launcher's JSON (`dataclasses.asdict`) read back
            self.ckpt = CkptOptions(**self.ckpt)
        # JSON made the rank keys strings
        self.inject_delay = {int(k): float(v) for k, v in self.inject_delay.items()}
        self.inject_data_delay = {int(k): float(v) for k, v in self.inject_data_delay.items()}
        self.inject_crash = {int(k): int(v) for k, v in self.inject_crash.items()}
        self.inject_hang = {int(k): int(v) for k, v in self.inject_hang.items()}

