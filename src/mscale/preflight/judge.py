"""Judging measured figures against peers, against a link rate, and blaming a node for a link.

Two outlier rules; either flags a value (docs/preflight.md):
- mean − 2σ over the peers (the rule operators know; weak with few devices: one outlier inflates
  σ, and among n values none can lie more than (n−1)/√n σ below the mean — never 2σ for n ≤ 5);
- the robust rule of Iglewicz and Hoaglin: modified z = 0.6745·(x − median)/MAD below −3.5.
A flagged value is WARNING below 0.8 × the peers' median; any value below 0.5 × the median of
three or more peers is CRITICAL on its own (with four groups of a kind no statistical rule can
tell one at a quarter of the speed from noise, yet the median of the others already says it);
of two values, one below 0.5 × the other is CRITICAL (a 2-node job has two TP groups). A
value within 20 % of the median is never flagged, so scheduling noise on shared CPUs (a healthy
run repeated) raises nothing while a device at half speed always does.

Those fractions are a GPU cluster's (`STRICT`). A CPU/gloo run — many processes sharing a few
cores, as `--local 8` on a two-core machine — is judged with `SHARED_CORES`' wider band: there a
healthy rank's GEMM was seen at 0.73 x its peers' median when the scheduler gave its core away,
which a GPU never does. Every flagged figure is then measured again (`recheck.py`) and stays
flagged only if it is slow both times; the report says which tolerance it was judged with.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Hashable

from mscale.config.preflight import STATUS_CODE, CheckResult

SIGMAS = 2.0
MODIFIED_Z = 3.5
MAD_SCALE = 0.6745
WARN_FRACTION = 0.8
LINK_WARN_PEER_FRACTION = 0.6
"""Links are judged with a wider band than devices: a link's figure also carries other traffic
and, on CPUs, the scheduling of both ends (healthy runs here reached 0.7 x the median)."""
CRIT_FRACTION = 0.5
LINK_WARN_FRACTION = 0.6
LINK_CRIT_FRACTION = 0.3
SEVERITY = {"OK": 0, "UNKNOWN": 1, "WARNING": 2, "CRITICAL": 3}
"""Order for the job's status: a check that could not measure is worse than OK but better than
one that measured a fault (Nagios aggregators rank it the same way)."""


@dataclass(frozen=True)
class Tolerance:
    """How far below its peers' median a figure may fall before it is flagged."""

    name: str
    device_warn: float
    """GEMM: flagged (2σ or modified z) and below this fraction of the median → WARNING."""
    link_warn: float
    """Pairs and groups: the same, with a wider band (links carry other traffic too)."""
    critical: float
    """Any figure below this fraction of the median of three or more → CRITICAL."""
    why: str

    def as_record(self) -> dict:
        return {"name": self.name, "device_warn": self.device_warn,
                "link_warn": self.link_warn, "critical": self.critical, "why": self.why}


STRICT = Tolerance("strict", WARN_FRACTION, LINK_WARN_PEER_FRACTION, CRIT_FRACTION,
                   "GPUs: each rank owns its device and its link")
SHARED_CORES = Tolerance(
    "shared-cores", 0.6, 0.45, 0.4,
    "CPU/gloo processes share the host's cores: a healthy rank loses its core now and then "
    "(seen at 0.73 x its peers' GEMM); an injected 4x slowdown measures 0.25")


def tolerance_for(on_gpu: bool) -> Tolerance:
    return STRICT if on_gpu else SHARED_CORES


@dataclass(frozen=True)
class Verdict:
    status: str
    expected: str
    evidence: dict


def judge_peers(values: dict[Hashable, float], warn: float = WARN_FRACTION,
                critical: float = CRIT_FRACTION) -> dict[Hashable, Verdict]:
    """Judge each value (higher is better) against the others of its kind; flagged values
    under ``warn`` x the median are WARNING, any under ``critical`` x the median CRITICAL;
    of two values, each is judged against the other (`_judge_pair`)."""
    xs = list(values.values())
    if len(xs) == 2:
        return _judge_pair(values, critical)
    if len(xs) < 2:
        return {k: Verdict("OK", "compared with peers (needs >= 2)", {}) for k in values}
    median = statistics.median(xs)
    mean = statistics.fmean(xs)
    sigma = statistics.pstdev(xs)
    mad = statistics.median(abs(x - median) for x in xs) or 1e-12 * max(abs(median), 1.0)
    low = mean - SIGMAS * sigma
    out = {}
    for k, x in values.items():
        z = MAD_SCALE * (x - median) / mad
        flagged = x < low or z < -MODIFIED_Z
        frac = x / median if median > 0 else 1.0
        status = "OK"
        if frac < critical:
            status = "CRITICAL"
        elif flagged and frac < warn:
            status = "WARNING"
        out[k] = Verdict(status, f">= {warn:g} x peers' median {median:.4g}",
                         {"median": median, "mean": mean, "sigma": sigma, "mad": mad,
                          "modified_z": z, "fraction_of_median": frac})
    return out


def _judge_pair(values: dict[Hashable, float], critical: float) -> dict[Hashable, Verdict]:
    """Two values: each against the other. No spread to flag a WARNING by, but the lower one
    far below the higher is slow: a 2-node job's only two TP groups, one at 2 MB/s and one at
    1 GB/s, were both OK (exit 0) before. A link or device is never abnormally fast, so the
    higher one is the reference; ``critical`` (0.4 on shared cores, where healthy links reached
    0.7 x) keeps noise out, and the re-check measures it a second time."""
    (a, x), (b, y) = values.items()
    out = {}
    for k, mine, other in ((a, x, y), (b, y, x)):
        frac = mine / other if other > 0 else 1.0
        out[k] = Verdict("CRITICAL" if frac < critical else "OK",
                         f">= {critical:g} x its one peer {other:.4g}",
                         {"median": other, "peers": 1, "fraction_of_median": frac})
    return out


def judge_rate(value: float, rate: float | None) -> tuple[str, str]:
    """Judge a bandwidth against the cluster file's link rate (None: not judged, e.g. on gloo)."""
    if not rate:
        return "OK", ""
    if value < LINK_CRIT_FRACTION * rate:
        return "CRITICAL", f">= {LINK_WARN_FRACTION:g} x link {rate:.4g}"
    if value < LINK_WARN_FRACTION * rate:
        return "WARNING", f">= {LINK_WARN_FRACTION:g} x link {rate:.4g}"
    return "OK", f">= {LINK_WARN_FRACTION:g} x link {rate:.4g}"


def worse(a: str, b: str) -> str:
    return a if SEVERITY[a] >= SEVERITY[b] else b


def job_status(results: list[CheckResult]) -> str:
    status = "OK"
    for r in results:
        status = worse(status, r.status)
    return status


def exit_code(status: str) -> int:
    return STATUS_CODE[status]


def blame_links(results: list[CheckResult], node_of: dict[int, str]) -> None:
    """Name the node at fault for each slow link (pair or group), in place, when one can be told.

    A rank is a suspect when its slow links reach two or more different sets of peers (a slow
    rank drags every link it is on; its peers each share only the one link with it). A slow link
    whose suspects all sit on one node is blamed on that node; so is a slow link with no suspect
    whose ranks all sit on one node (no switch lies between them: the node's own NVLink, PCIe,
    or NIC loopback; a 2-node job's slow TP group is seen only so); otherwise on nobody (a slow
    switch port between two healthy nodes must not exclude either).
    """
    links = [r for r in results if r.entity_kind in ("pair", "group") and r.value is not None]
    slow_sets: dict[int, set[tuple[int, ...]]] = {}
    for r in links:
        if r.status in ("WARNING", "CRITICAL"):
            for rank in r.ranks:
                slow_sets.setdefault(rank, set()).add(tuple(sorted(r.ranks)))
    suspects = {rank for rank, sets in slow_sets.items() if len(sets) >= 2}
    for r in links:
        if r.status not in ("WARNING", "CRITICAL"):
            continue
        nodes = {node_of[x] for x in r.ranks if x in suspects}
        if not nodes and len({node_of[x] for x in r.ranks}) == 1:
            r.node = node_of[r.ranks[0]]
            r.evidence["blame"] = "inside_node"
            r.message += f"; all its ranks are on {r.node}: {r.node} is at fault"
        elif len(nodes) == 1:
            r.node = nodes.pop()
            r.evidence["blame"] = "slow_ranks"
            r.message += f"; its rank(s) on {r.node} are slow on every peer set: {r.node} is at fault"
        else:
            r.node = None
