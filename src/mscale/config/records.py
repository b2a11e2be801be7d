"""Records of the run directory shared by train, watch, recover and ckpt.

Every record carries ``schema_version`` so that a reader can refuse a file from the future
instead of misreading it.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_serializer, field_validator, model_validator

from mscale.config.base import StrictModel
from mscale.config.vectors import COMPACT_MIN_RANKS, decode_vector, encode_vector, is_encoded

RECORD_SCHEMA_VERSION = 1
METRICS_SCHEMA_VERSION = 2
"""Newest `MetricsRecord` version: 2 may carry per-rank vectors encoded (config/vectors.py)."""
LINK_FIELDS = ("comm_tp", "comm_pp", "comm_dp")
"""The optional split of communication by the kind of group waited on (train/timers.py)."""
PER_RANK_FIELDS = ("step_time", "compute_time", "comm_wait", "data_time", "bubble_time",
                   *LINK_FIELDS)
LINK_SCALE = 1e-3
"""Resolution of the link vectors in version 2: 1 ms. The slow-link rule's smallest bar is a
few percent of a step (tens of milliseconds), and coarser integers compress better: the three
vectors add ~35 kB a step at 12,288 ranks (191 kB in all) where 1 µs would add ~105 kB
(docs/benchmarks.md, "watch")."""
HOSTLIST_SYNTAX = re.compile(r"[\s,\[\]]")
"""What never appears in one host name: a hostlist's separators and brackets, blanks."""
_NON_FINITE_AS_NULL = ("loss", "grad_norm", "clip_threshold", "lr", "tokens_per_s")
"""Required numbers that JSON writes as null when they are NaN or infinite (it has no NaN)."""


def metrics_version_for(world: int) -> int:
    """The version mscale writes for a world: compact vectors only where they pay
    (`COMPACT_MIN_RANKS`), so small runs stay plain JSON lists that any tool reads."""
    return METRICS_SCHEMA_VERSION if world >= COMPACT_MIN_RANKS else 1


class RecordModel(StrictModel):
    """Base of the run-directory records: what training measured, kept as measured.

    Unlike configs, records may hold NaN and infinity (a NaN loss is exactly what a record must
    be able to say), and values are coerced (a numpy or torch scalar is still a number): records
    are written by mscale itself during a run, where a refusal would kill the job."""

    model_config = ConfigDict(strict=False, allow_inf_nan=True)


class MetricsRecord(RecordModel):
    """One line of ``metrics.jsonl``, written by rank 0 after every step.

    Per-rank vectors are indexed by global rank and were gathered with one collective. In memory
    they are always lists; a version-2 record writes them encoded (config/vectors.py) and reading
    one decodes them, so every user of the model sees lists whatever the file holds.
    """

    schema_version: int = RECORD_SCHEMA_VERSION
    """Version of the record schema: 1 writes per-rank vectors as JSON lists, 2 encoded."""
    step: int
    """Optimizer step just completed (1-based)."""
    time: float = Field(default_factory=time.time)
    """Unix wall time when the record was written."""
    loss: float
    """Mean loss over all micro-batches and DP replicas of the step."""
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    clip_threshold: float
    """The clipping threshold in force for this step."""
    lr: float
    """Learning rate used for this step."""
    tokens: int
    """Tokens processed in this step over all replicas."""
    tokens_per_s: float
    """Throughput of this step."""
    mfu: float | None = None
    """Model FLOPs utilisation against the plan's dense peak (0..1)."""
    step_time: list[float]
    """Seconds per rank for the whole step."""
    compute_time: list[float]
    """Seconds per rank spent computing (forward, backward, optimizer)."""
    comm_wait: list[float]
    """Seconds per rank blocked on communication (exposed, not overlapped)."""
    data_time: list[float]
    """Seconds per rank waiting for data."""
    bubble_time: list[float] | None = None
    """Seconds per rank idle in the pipeline bubble (pipeline runs)."""
    comm_tp: list[float] | None = None
    """Seconds per rank waiting in tensor-parallel collectives (part of ``comm_wait``)."""
    comm_pp: list[float] | None = None
    """Seconds per rank waiting on pipeline sends and receives (in ``comm_wait`` or, during the
    pipeline's warm-up and cool-down, ``bubble_time``)."""
    comm_dp: list[float] | None = None
    """Seconds per rank waiting on the data-parallel reduction and parameter gathers (part of
    ``comm_wait``). These three let watch compare groups of one kind with each other and name
    the rank whose link every slow group shares (docs/watch.md, "slow_link")."""
    eval_loss: float | None = None
    """Mean loss on the held-out batches, on the steps that evaluated (docs/data.md)."""
    eval_perplexity: float | None = None
    """``exp(eval_loss)``."""
    extra: dict[str, Any] = {}
    """Anything else worth keeping (e.g. skipped-step flags)."""

    @model_validator(mode="before")
    @classmethod
    def _decode_vectors(cls, data: Any) -> Any:
        """Refuse a record from the future; read null as the NaN it was written for; turn
        encoded vectors into lists."""
        if not isinstance(data, dict):
            return data
        version = data.get("schema_version", 1)
        if isinstance(version, int) and version > METRICS_SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is newer than this mscale understands "
                             f"({METRICS_SCHEMA_VERSION}): upgrade mscale")
        out = dict(data)
        for k in _NON_FINITE_AS_NULL:
            if k in out and out[k] is None:
                out[k] = math.nan
        for k in PER_RANK_FIELDS:
            if is_encoded(out.get(k)):
                out[k] = decode_vector(out[k], field=k).tolist()
        return out

    @field_serializer(*PER_RANK_FIELDS)
    def _encode_vectors(self, v: list[float] | None, info) -> Any:
        """Version 2 writes each vector in the compact form (~10x smaller at 12,288 ranks); the
        split of communication by kind at 1 ms (`LINK_SCALE`)."""
        if v is None or self.schema_version < 2:
            return v
        return encode_vector(v, scale=LINK_SCALE) if info.field_name in LINK_FIELDS \
            else encode_vector(v)


EventKind = Literal[
    "start", "stop", "nan", "divergence", "grad_spike", "straggler", "throughput", "hang",
    "signal", "control", "checkpoint", "checkpoint_failed", "recover", "preflight", "info",
]


class Event(RecordModel):
    """One line of ``events.jsonl``: an alert or a decision, with its evidence."""

    schema_version: int = RECORD_SCHEMA_VERSION
    """Version of the record schema."""
    time: float = Field(default_factory=time.time)
    """Unix wall time."""
    source: Literal["train", "watch", "recover", "preflight", "ckpt", "plan"]
    """Which subcommand wrote it."""
    kind: EventKind
    """What happened."""
    severity: Literal["info", "warning", "critical"] = "info"
    """How bad."""
    step: int | None = None
    """Training step it refers to, if any."""
    ranks: list[int] = []
    """Global ranks implicated."""
    nodes: list[str] = []
    """Nodes implicated."""
    message: str = ""
    """One human sentence."""
    evidence: dict[str, Any] = {}
    """The numbers behind the decision."""


class QuarantineEntry(RecordModel):
    """A node kept out of future launches."""

    node: str
    """Node name as SLURM knows it."""
    reason: str
    """Why, in one sentence."""
    since: float = Field(default_factory=time.time)
    """Unix time it was quarantined."""
    expires: float | None = None
    """Unix time after which it may be used again; None = until a human clears it."""
    evidence: dict[str, Any] = {}
    """The numbers behind the decision."""

    @field_validator("node")
    @classmethod
    def _one_node(cls, node: str) -> str:
        """One host name: a hand-written ``gpu[017,203]`` (a hostlist) or a blank crashed
        preflight's exclude list (an internal error after every measurement), and matched no
        node of a job."""
        if not node or HOSTLIST_SYNTAX.search(node):
            raise ValueError(f"{node!r} is not one node name (a hostlist, or blanks?); write one "
                             "entry per node, named as SLURM names it (node017)")
        return node


QUARANTINE_FIX = ("correct the JSON by hand (a trailing comma, a missing quote) or remove the "
                  "file to release every node; watch writes it whole, so an edit broke it")
"""What to do about a ``quarantine.json`` that does not parse (recover and preflight alike)."""


class Quarantine(RecordModel):
    """``quarantine.json``."""

    schema_version: int = RECORD_SCHEMA_VERSION
    """Version of the record schema."""
    entries: list[QuarantineEntry] = []
    """Nodes kept out, one entry each."""


class DataSkip(RecordModel):
    """One data window skipped on a rollback: after resuming from ``after_step``, the samples of
    the next ``skip_steps`` steps are passed over (they led to a divergence or NaN)."""

    after_step: int = Field(ge=0)
    """Step of the checkpoint the run resumed from."""
    skip_steps: int = Field(ge=1)
    """Steps' worth of global batches skipped: step t > after_step reads the samples that step
    t + skip_steps would have read."""
    global_batch: int | None = Field(default=None, ge=1)
    """Global batch of the steps skipped, so the window is ``skip_steps · global_batch`` samples
    even when a later restart changes the batch; None (older records): the batch in force."""
    reason: str = ""
    """Why, in one sentence (the divergence or NaN that caused the rollback)."""
    attempt: int | None = Field(default=None, ge=0)
    """The failed attempt this window answers: `mscale recover --execute` run twice on the same
    failure (or two at once) records it once, since a window recorded twice is skipped twice.
    None (older records): not known."""
    time: float = Field(default_factory=time.time)
    """Unix time it was recorded."""


class DataSkips(RecordModel):
    """``data_skip.json``: every window skipped so far, in the order recorded. Written by
    `mscale recover`, read by `mscale train` when it starts; offsets add up."""

    schema_version: int = RECORD_SCHEMA_VERSION
    """Version of the record schema."""
    entries: list[DataSkip] = []
    """Windows skipped, oldest first."""

    def sample_step(self, step: int) -> int:
        """The step whose samples training step ``step`` (1-based) reads."""
        return step + sum(e.skip_steps for e in self.entries if step > e.after_step)

    def skipped_samples(self, first: int, last: int, global_batch: int) -> int:
        """Samples skipped by the windows recorded after steps ``first`` to ``last`` (inclusive),
        i.e. those that move 0-based steps first..last; a window without its own batch counts
        ``global_batch`` per step."""
        return sum(e.skip_steps * (e.global_batch or global_batch) for e in self.entries
                   if first <= e.after_step <= last)
