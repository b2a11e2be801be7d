"""Run-time options of one training job that are not part of the plan, declared once.

Each field is declared here once, with its docstring; `mscale train`'s flags and their help are
derived from these fields (`cli/train.py`, `cli/options.py`), and the ``--local`` launcher hands
the whole object to its workers as JSON (`model_dump_json` / `model_validate_json`). A new option
is one field and one docstring. Fields that are not flags (`launch`, `progress`) say so.
Torch-free: the launcher imports this and must start its workers without loading torch.
"""

from __future__ import annotations

from pydantic import Field

from mscale.ckpt.options import CkptOptions
from mscale.config.base import NOT_A_FLAG, StrictModel, flag


class FaultPlan(StrictModel):
    """Test hooks: make a real job fail the way a real fault does (docs/train.md). Hidden flags.

    Every hook fires in attempt 1 of a run directory only, so a relaunch of the same command (by
    hand or by ``mscale recover``) trains cleanly. They act through wrappers that
    `mscale.train.faults.install` puts around the engine's parts when it is built; the
    production modules carry no test branches."""

    delay: dict[int, float] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-delay", hidden=True, metavar="RANK:SECONDS", bounds=(0, 3600)))
    """Seconds of extra compute per step on a rank, spread over its forwards (a slow GPU)."""
    data_delay: dict[int, float] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-data-delay", hidden=True, metavar="RANK:SECONDS", bounds=(0, 3600)))
    """Seconds a rank's data loader takes longer per step (a slow reader)."""
    nan_step: int | None = Field(None, ge=1, json_schema_extra=flag("--inject-nan", hidden=True))
    """Make the loss NaN at this (1-based) step: NaN flows through backward into every gradient,
    as a real numerical blow-up does."""
    crash: dict[int, int] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-crash", hidden=True, metavar="RANK:STEP", bounds=(1, 10**9)))
    """The rank SIGKILLs itself at that step, right after its first micro-batch's forward."""
    hang: dict[int, int] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-hang", hidden=True, metavar="RANK:STEP", bounds=(1, 10**9)))
    """The rank SIGSTOPs itself at the same point: a hung process that never times out itself."""
    ckpt_enospc_step: int | None = Field(None, ge=1, json_schema_extra=flag(
        "--inject-ckpt-enospc", hidden=True))
    """The save of this step fails on every rank with a real ``OSError(ENOSPC)`` after its first
    chunk is written (a full checkpoint filesystem)."""
    ckpt_eio_step: int | None = Field(None, ge=1, json_schema_extra=flag(
        "--inject-ckpt-eio", hidden=True))
    """As --inject-ckpt-enospc with ``OSError(EIO)``: a storage error that is not a full disk
    (training goes on; a failed final save still makes the exit 3)."""
    ckpt_kill: dict[int, int] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-ckpt-kill", hidden=True, metavar="RANK:STEP", bounds=(1, 10**9)))
    """The rank's writer SIGKILLs the process after the first chunk of that step's save."""
    ckpt_hang: dict[int, int] = Field(default_factory=dict, json_schema_extra=flag(
        "--inject-ckpt-hang", hidden=True, metavar="RANK:STEP", bounds=(1, 10**9)))
    """As --inject-ckpt-kill with SIGSTOP (a rank hung in the middle of a save)."""
    ckpt_chunk_delay_s: float = Field(0.0, ge=0, json_schema_extra=flag(
        "--inject-ckpt-delay", hidden=True))
    """The checkpoint writer sleeps this long after each chunk (a slow filesystem)."""
    ckpt_copy_delay_s: float = Field(0.0, ge=0, json_schema_extra=flag(
        "--inject-ckpt-copy-delay", hidden=True))
    """The checkpoint writer sleeps this long before the host copy (a slow copy, which the next
    optimizer step must wait for)."""

    @property
    def armed(self) -> bool:
        return self != FaultPlan()

    def rank_hooks(self) -> dict[str, dict[int, float]]:
        """The hooks that name ranks, by flag (the launcher checks the ranks exist)."""
        fields = type(self).model_fields
        return {f.json_schema_extra["flag"]: getattr(self, name) for name, f in fields.items()
                if isinstance(getattr(self, name), dict)}


class TrainOptions(StrictModel):
    """Switches of one training job; the plan holds everything about the model and layout."""

    run_dir: str = Field(json_schema_extra=NOT_A_FLAG)
    """Run directory (local path or fsspec URL); `mscale train`'s --run-dir, which the CLI
    checks itself (a default for the embedded demo)."""
    steps: int | None = Field(None, ge=1, json_schema_extra=flag("--steps"))
    """Train this many steps instead of training.steps; the LR schedule is laid over them."""
    timeout_s: float = Field(120.0, gt=0, json_schema_extra=flag("--timeout"))
    """Seconds before a hung collective fails the job."""
    log_interval: int = Field(1, ge=1, json_schema_extra=flag("--log-interval"))
    """Steps between progress lines when stdout is not a terminal (a terminal gets one
    progress bar, redrawn); a line's tok/s and step time are the mean of its steps."""
    trace_every: int = Field(0, ge=0, json_schema_extra=flag("--trace-every"))
    """Steps between timelines written to RUN_DIR/trace/ (Perfetto / chrome://tracing); 0: only
    when RUN_DIR/control/trace asks. A traced step gathers every rank's events to rank 0, so keep
    it rare at scale."""
    trace_ranks: str = Field("replica", pattern="^(replica|all)$",
                             json_schema_extra=flag("--trace-ranks", choices=("replica", "all")))
    """Whose events a timeline holds: replica (DP replica 0's pipeline) or all."""
    allow_batch_change: bool = Field(False, json_schema_extra=flag("--allow-batch-change"))
    """Accept a plan whose global batch differs from the run directory's; the data continues
    from the samples already consumed."""
    allow_data_change: bool = Field(False, json_schema_extra=flag("--allow-data-change"))
    """Accept a plan whose training.data differs from the run directory's (a curriculum step:
    new blend weights or sources), and data that changed under the checkpoint; the run continues
    at the same global sample of the new data, and says so (docs/data.md)."""
    json_summary: bool = Field(False, json_schema_extra=flag("--json"))
    """Print one JSON summary document at the end on stdout (console lines go to stderr)."""
    gc_interval: int = Field(50, ge=1, json_schema_extra=NOT_A_FLAG)
    """Steps between synchronized garbage collections (automatic GC is off)."""
    progress: bool = Field(True, json_schema_extra=NOT_A_FLAG)
    """Show a progress bar / progress lines on rank 0 (tests turn it off)."""
    ckpt: CkptOptions = Field(default_factory=CkptOptions)
    """Checkpoint switches: interval, retention, zstd level, final save, --resume."""
    faults: FaultPlan = Field(default_factory=FaultPlan)
    """Test hooks (hidden flags)."""
    launch: dict | None = Field(None, json_schema_extra=NOT_A_FLAG)
    """How the job was launched, as the user typed it (argv, cwd, absolute plan path, --local N),
    recorded in the ``start`` event for `mscale recover` to relaunch it; set by the CLI."""
