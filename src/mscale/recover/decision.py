"""The shapes that flow through a recovery, declared once.

`diagnose` (evidence → `Diagnosis`) → `checkpoints` (→ `CheckpointChoice`) → `exclude`
(→ `Exclusions`) → `replan` (→ `Replan`) → `relaunch` (→ the command) make one
`RecoveryPlan`.
Each stage is a library function over the run directory; `mscale recover` prints the plan and
`--execute` / `supervise` carry it out. Every field is JSON-able (`to_json`), because the plan is
also `--json`'s document and the `recover` event's evidence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

FailureClass = Literal["gpu", "network", "storage", "software", "preemption", "user_code",
                       "numerics", "unknown", "none"]
"""What broke. ``numerics``: NaN/Inf or a divergence (a rollback, not a node, fixes it);
``none``: the run did not fail (finished, or stopped on request)."""

Symptom = Literal["crash", "signal", "hang", "timeout", "oom", "nan", "divergence", "straggler",
                  "disk_full", "bad_input", "damaged_checkpoint", "preempted", "stopped",
                  "finished", "unknown"]
"""How the failure showed itself; the class is the cause behind it. ``damaged_checkpoint``: the
resume read a checkpoint whose files are damaged (a chunk's checksum, a missing or cut shard):
the storage's fault, not the input's nor a node's; an older checkpoint gets past it."""

Verify = Literal["quick", "full"]
"""How a checkpoint is verified before recover trusts it: ``quick`` (manifest, commit marker,
sizes) or ``full`` (every chunk's crc); `mscale recover --verify`'s choices."""

Verdict = Literal["relaunchable", "degraded", "unrecoverable", "finished"]
"""0: relaunch as it was; 1: relaunch with less (fewer nodes, an older checkpoint, a skipped
data window); 2: a human must act (bad input, user code, nothing to resume from and more than a
checkpoint interval to lose: recover/start_over.py); ``finished``
(0): the run trained every step, nothing to relaunch (no command)."""


@dataclass
class Evidence:
    """One line that supports a diagnosis, with where it was read."""

    source: str
    """File it came from, relative to the run directory (``logs/rank3.error.json``)."""
    text: str
    """The line itself (or a one-line digest of a record), at most ~300 characters."""
    rank: int | None = None
    """Global rank it concerns, when one."""
    node: str | None = None
    """Node it concerns, when one."""
    also_ranks: list[int] = field(default_factory=list)
    """Other ranks that wrote the same line, ports, addresses and numbers aside (every peer of a
    killed rank logs its own ``Connection closed by peer``): one line, not one per rank."""


@dataclass
class Diagnosis:
    """What went wrong in the last attempt of a run, and who is suspect."""

    cls: FailureClass
    """The failure class."""
    symptom: Symptom
    """How it showed itself."""
    summary: str
    """One sentence for the operator."""
    evidence: list[Evidence] = field(default_factory=list)
    """The lines that decided it, most telling first."""
    suspect_ranks: list[int] = field(default_factory=list)
    """Ranks whose process or device is suspected (the hung or first-failed one, not its peers)."""
    suspect_nodes: list[str] = field(default_factory=list)
    """Nodes to re-check (preflight) and, if they fail it or the evidence is hardware, exclude."""
    failed_step: int | None = None
    """Last step the run completed before it stopped (from metrics/events), None when unknown."""
    bad_step: int | None = None
    """First bad step of a NaN/divergence/spike episode: the checkpoint must precede it."""
    attempt: int | None = None
    """Attempt number of the run that failed (`mscale.runs.lock.next_attempt`)."""
    exit_code: int | None = None
    """The job's exit code when recorded (launcher stop event), else None."""
    transient: bool = False
    """A plain relaunch is likely to work (preemption, a one-off NaN, a network flap)."""
    rule: str | None = None
    """The key of the rule that decided it (diagnose/rules.py), e.g. ``peer_gone``."""
    damaged_checkpoint: str | None = None
    """The checkpoint directory the attempt failed reading (symptom ``damaged_checkpoint``), as
    the failure named it, made absolute against the launch's working directory; the checkpoint
    choice passes it over like one that fails verification."""
    damaged_error: str | None = None
    """What the read said of it (the error's message without its fix)."""
    link_suspects: list[str] = field(default_factory=list)
    """A slow link watch could not place (rule ``slow_link``): the nodes it may be on. Never
    excluded nor re-checked as suspects: one of them is healthy, and the job's own preflight
    cannot tell which (the finding's advice says what can)."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class CheckpointChoice:
    """The checkpoint to resume from, and the newer ones passed over with why."""

    path: str | None
    """Checkpoint directory (URL) to resume from; None: nothing usable (start fresh or give up)."""
    step: int | None
    """Its step."""
    reason: str
    """Why this one, in one sentence."""
    rejected: list[dict] = field(default_factory=list)
    """Newer checkpoints not used: ``{"name": ..., "why": ...}`` (failed verify, after the bad
    step, uncommitted)."""
    is_latest: bool = True
    """True when ``--resume auto`` loads it (the relaunch needs no ``--resume``)."""
    rollback: bool = False
    """A committed checkpoint newer than it is passed over: trained steps are lost (the verdict
    is degraded). Not so after a crash between a commit and ``latest``. Recover pins the choice
    whenever the relaunch names it (not ``is_latest``), so that retention keeps what the
    command's ``--resume`` points at."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Exclusions:
    """Nodes kept out of the relaunch, each with its reason."""

    nodes: list[str] = field(default_factory=list)
    """Sorted node names."""
    reasons: dict[str, str] = field(default_factory=dict)
    """node → why (quarantine.json, preflight.json, the diagnosis, a failed re-check)."""
    notes: list[str] = field(default_factory=list)
    """Evidence passed over and why, one sentence each (a preflight.json older than the failed
    attempt): a node named bad somewhere and not kept out must say why."""
    carried: dict[str, str] = field(default_factory=dict)
    """node → why, for the nodes the job itself already kept out (its command's
    ``-x``/``--exclude``, its allocation's ``ExcNodeList``) that the failed attempt ran on and
    quarantine did not release (`exclude.with_carried`): not this recovery's verdict, but the
    relaunch keeps them out too, so the re-plan cannot count them."""
    released: list[str] = field(default_factory=list)
    """Nodes the job already kept out that the relaunch lets back, quarantine no longer holding
    them (`exclude.released`). The decision document records them: once let back, a node that
    is in the job's exclusions again was put there by an operator since, and stays out."""

    @property
    def kept_out(self) -> list[str]:
        """Every node the relaunch cannot use: this recovery's and the job's own, sorted."""
        return sorted({*self.nodes, *self.carried})

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Replan:
    """The layout for the nodes that remain, when exclusions shrink the world."""

    plan_path: str | None
    """Where the new plan was (or, in a dry run, would be) written; None: the old plan stands."""
    nodes: list[str]
    """Nodes the relaunch uses, in placement order."""
    world: int
    """Ranks of the relaunch."""
    layout: str
    """New layout in one line (`mscale.runs.history.describe_layout`)."""
    old_layout: str
    """The layout it replaces."""
    old_step_time_s: float | None = None
    """Planner's predicted step time of the old layout on the old world."""
    new_step_time_s: float | None = None
    """Planner's predicted step time of the new layout on the remaining world."""
    global_batch: int | None = None
    """Global batch of the new plan."""
    batch_changed: bool = False
    """True only when asked (``--allow-batch-change``) and no layout kept it."""
    unused_nodes: list[str] = field(default_factory=list)
    """Healthy nodes left idle because no layout fits all of them with the same global batch."""
    note: str = ""
    """What the change costs, in one sentence."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class RecoveryPlan:
    """Everything `mscale recover` decided about one failed run."""

    run_dir: str
    verdict: Verdict
    diagnosis: Diagnosis
    checkpoint: CheckpointChoice
    exclusions: Exclusions
    replan: Replan | None = None
    data_skip: dict | None = None
    """The data window to skip on rollback (`mscale.config.records.DataSkip` as JSON), or None."""
    launcher: str = "unknown"
    """How the run was launched: ``local``, ``slurm`` (sbatch/srun), ``torchrun``."""
    command: list[str] = field(default_factory=list)
    """The relaunch command, argv form (empty when unrecoverable)."""
    cwd: str | None = None
    """The directory the command runs in: the job's own, as its start event recorded it (the
    command's relative paths are taken from there); None when unknown."""
    reasons: list[str] = field(default_factory=list)
    """Why the verdict, one sentence each (every degradation and every refusal)."""

    @property
    def exit_code(self) -> int:
        return {"relaunchable": 0, "degraded": 1, "unrecoverable": 2, "finished": 0}[self.verdict]

    def to_json(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code}
