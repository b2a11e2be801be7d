"""What watch concludes: a finding with its cause, evidence and what fixing it would buy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]

Kind = Literal["straggler", "grad_spike", "nan", "divergence", "throughput", "hang", "stop",
               "checkpoint"]
"""``stop``: the job's newest attempt ended other than by finishing; ``checkpoint``: one of its
saves failed (both from the job's own events, watch/ending.py)."""

Cause = Literal[
    "slow_device",      # one rank persistently high on compute; its peers' wait grows
    "slow_node",        # every rank of one node (a node-level problem: power, cooling, PCIe)
    "slow_link",        # every rank waiting on one peer's traffic
    "slow_data",        # high data_time on the reading ranks (TP rank 0) of one group
    "stage_imbalance",  # every rank of one pipeline stage high on compute: re-plan
    "data_imbalance",   # the slow rank changes step to step inside a DP group: rebalance data
    "job_wide",         # every rank slower than the run's own baseline (network, storage)
    "none",             # not a straggler finding
    # a ``stop`` finding: how the job's newest attempt ended (watch/ending.py)
    "on_request",       # halt or signal: a checkpoint saved, exit 1
    "nan",              # a non-finite gradient norm stopped every rank, exit 2
    "aborted",          # rank 0 could not go on (a full disk), exit 3
    "interrupted",      # the operator stopped it without a checkpoint, exit 130
    "crashed",          # a rank failed or was killed, exit 3
    "hang",             # ranks stopped answering, exit 3
    "died",             # gone without recording its end (watch/liveness.py): no exit code
]

HARDWARE_CAUSES = ("slow_device", "slow_node", "slow_link")
"""Only these may put a node in quarantine; imbalance causes produce advice only."""
COSTLY_CAUSES = (*HARDWARE_CAUSES, "job_wide")
"""The stragglers graded by their cost (`WatchConfig.critical_slowdown_pct`): a fault, not the
plan's or the data's imbalance. A job-wide slowdown names no node to take out, but a job five
times slower loses four GPU-hours in five whoever is to blame (the fabric, the storage, a
co-located job), which on-call must hear as loudly as a sick GPU that costs as much."""


@dataclass
class Finding:
    """One conclusion about the run, emitted once per ``key`` (not re-emitted every step)."""

    kind: Kind
    severity: Severity
    message: str
    """One human sentence: what, where, and what to do."""
    cause: Cause = "none"
    ranks: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    slowdown_pct: float | None = None
    """What-if: how much slower the job is because of this (step time vs. the step time if the
    named rank/node/stage were typical), in percent."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """The numbers that decided it (values, baselines, thresholds, which rule)."""
    advice: str = ""
    """What the operator (or recover) should do."""

    @property
    def key(self) -> tuple:
        """Identity for de-duplication: the same problem on the same ranks is one finding."""
        return (self.kind, self.cause, tuple(self.ranks), tuple(self.nodes))

    @property
    def hardware(self) -> bool:
        return self.kind == "straggler" and self.cause in HARDWARE_CAUSES

    @property
    def graded_by_cost(self) -> bool:
        return self.kind == "straggler" and self.cause in COSTLY_CAUSES
