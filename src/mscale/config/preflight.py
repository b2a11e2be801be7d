"""``preflight.json``: what `mscale preflight` measured and judged, for people and for tools.

Every check result names its entity (a node, a rank, a pair of ranks, a process group), the
measured value with its unit, what was expected, and a status in the Nagios convention, so
`recover` can read which nodes failed why and `plan --calibrate` can read measured GEMM
throughput and bus bandwidth instead of datasheet numbers.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from mscale.config.records import RecordModel

PREFLIGHT_SCHEMA_VERSION = 1

Status = Literal["OK", "WARNING", "CRITICAL", "UNKNOWN"]
"""Nagios plugin convention; the exit code of a report is the worst status's index."""
STATUS_CODE: dict[str, int] = {"OK": 0, "WARNING": 1, "CRITICAL": 2, "UNKNOWN": 3}

EntityKind = Literal["node", "rank", "pair", "group", "storage", "job"]


class CheckResult(RecordModel):
    """One measured (or unmeasurable) fact about one entity."""

    check: str
    """Which check: ``gemm``, ``p2p``, ``allreduce``, ``allgather``, ``reduce_scatter``,
    ``gpu_health``, ``ib_port``, ``storage_write``, ``storage_read``, ``free_space``,
    ``clock_skew``, ``nccl_env``, ``rank_alive``, ``stopped`` (a phase that did not finish), ..."""
    entity_kind: EntityKind
    entity: str
    """The entity's name: a node name, ``rank 5``, ``3-7`` for a pair, ``dp[0,2,4,6]``."""
    node: str | None = None
    """The node to blame when this fails (for a pair or group: the node judged at fault, if
    one can be told; None when no single node is)."""
    ranks: list[int] = []
    value: float | None = None
    """The measured value; None when nothing could be measured (status UNKNOWN)."""
    unit: str = ""
    expected: str = ""
    """What was expected, as text: ``>= 0.8 × peers' median``, ``0 new link_downed``, ..."""
    status: Status
    message: str = ""
    """One sentence; for a failure, what is wrong and what to do."""
    evidence: dict[str, Any] = {}


class PreflightReport(RecordModel):
    """The whole of ``preflight.json``."""

    schema_version: int = PREFLIGHT_SCHEMA_VERSION
    time: float = Field(default_factory=time.time)
    level: Literal["quick", "full"] = "quick"
    plan: str | None = None
    """The plan file the groups came from."""
    world: int
    layout: dict[str, int] = {}
    """tp, pp, dp of the plan."""
    results: list[CheckResult] = []
    bad_nodes: list[str] = []
    """Nodes with a CRITICAL result blamed on them, merged with quarantine.json's live entries."""
    exclude: str = ""
    """``bad_nodes`` as a SLURM hostlist, ready for ``sbatch --exclude=``."""
    measured: dict[str, Any] = {}
    """What the planner can calibrate from: GEMM TFLOP/s per device (median, min), bus
    bandwidth per group kind (tp/pp/dp) and collective, storage write/read MB/s."""
    status: Status = "OK"
    """Worst status over the results."""
    judging: dict[str, Any] = {}
    """How the figures were judged: the tolerance (``strict`` on GPUs, ``shared-cores`` for
    CPU/gloo processes sharing cores), its fractions and why, how many suspects were measured
    a second time (``rechecked``) and how many of them were slow only once (``cleared``)."""
