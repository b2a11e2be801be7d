"""Which nodes a relaunch keeps out, each with its reason.

Three sources, each trusted for what it can know:

1. ``quarantine.json``: entries still in force at ``now`` (no expiry, or not expired). Watch
   (a hardware straggler) and operators write it; an expired entry is a node back in the pool.
2. ``preflight.json``: nodes a CRITICAL check blamed, but only when that preflight ran for the
   run's plan (same world and tp/pp/dp as ``RUN/plan.yaml``): a report for another layout tested
   other groups. Its ``bad_nodes`` also repeat quarantine.json's entries of the day; those are
   judged by rule 1 (so an expired one does not come back through preflight).
3. the diagnosis: suspect nodes when the failure class is hardware (``gpu``, ``network``).
   With a ``recheck`` (preflight run again on the suspects, `recover.recheck`), a suspect that
   re-checks healthy stays in, one that fails is out with the re-check's reason, and one the
   re-check could not reach is out on the diagnosis. For class ``unknown``, and for a network
   failure known only as a lost peer or a timeout (`LOST_PEER_RULES`: what every rank sees
   when another is killed, under torchrun with no other word of it), only a failed re-check
   excludes (a measured fault is evidence enough; a guess is not): a SIGKILLed torchrun worker
   cost its node, and on one node the whole run. A NCCL/InfiniBand error stays firm. Software, numerics,
   user code, preemption and storage failures never exclude nodes: another node would fail the
   same way, and every exclusion costs capacity for the rest of the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mscale.config.base import load_model
from mscale.config.plan import Plan
from mscale.config.preflight import PreflightReport
from mscale.config.records import Quarantine
from mscale.recover.decision import Diagnosis, Exclusions
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir

HARDWARE = ("gpu", "network")
"""Failure classes whose suspects are kept out."""
LOST_PEER_RULES = ("peer_gone", "collective_timeout", "network", "timeout")
"""Diagnosis rules (diagnose/rules.py) that see a peer go away, not the network fail."""

Recheck = Callable[[list[str]], dict[str, "str | None"]]
"""node list → node → failure reason, or None when healthy; unreachable nodes absent."""


def decide_exclusions(run: RunDir, diagnosis: Diagnosis, recheck: Recheck | None = None,
                      now: float | None = None) -> Exclusions:
    """The nodes to keep out and why (module docstring for the rules)."""
    now = time.time() if now is None else now
    reasons: dict[str, str] = {}
    for node, why in quarantined(run, now).items():
        reasons.setdefault(node, why)
    for node, why in preflight_bad(run).items():
        reasons.setdefault(node, why)
    # a suspect already kept out is not re-checked: a preflight on a node with a degraded link
    # is slow (minutes under SLURM) and could not bring it back anyway
    for node, why in suspects(diagnosis, recheck, skip=set(reasons)).items():
        reasons.setdefault(node, why)
    return Exclusions(nodes=sorted(reasons), reasons={n: reasons[n] for n in sorted(reasons)})


def _exists(url: str) -> bool:
    fs, path = fs_and_path(url)
    return fs.isfile(path)


def quarantined(run: RunDir, now: float) -> dict[str, str]:
    """Nodes quarantine.json keeps out at ``now``, with its reason."""
    if not _exists(run.quarantine):
        return {}
    q = load_model(Quarantine, run.quarantine)
    out = {}
    for e in q.entries:
        if e.expires is None or e.expires > now:
            until = "until cleared" if e.expires is None else \
                f"until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(e.expires))}"
            out.setdefault(e.node, f"quarantine.json ({until}): {e.reason}"[:300])
    return out


def preflight_bad(run: RunDir) -> dict[str, str]:
    """Nodes a CRITICAL preflight check blamed, when preflight ran for the run's plan."""
    if not _exists(run.preflight) or not _exists(run.plan):
        return {}
    report = load_model(PreflightReport, run.preflight)
    plan = load_model(Plan, run.plan)
    if not ran_for(report, plan):
        return {}
    out = {}
    for r in report.results:
        # a quarantine entry preflight repeated is quarantine.json's to judge (it may have
        # expired or been cleared since): it never comes back through preflight.json
        if r.check == "quarantine":
            continue
        if r.status == "CRITICAL" and r.node and r.node in report.bad_nodes:
            out.setdefault(r.node, f"preflight.json: {r.check} on {r.entity}: {r.message}"[:300])
    return out


def ran_for(report: PreflightReport, plan: Plan) -> bool:
    """True when ``report`` tested ``plan``'s groups: same world and tp/pp/dp."""
    lay = plan.layout
    return (report.world == lay.world_size
            and report.layout == {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp})


def suspects(diagnosis: Diagnosis, recheck: Recheck | None,
             skip: set[str] = frozenset()) -> dict[str, str]:
    """The diagnosis's suspect nodes to keep out (rule 3 of the module docstring), ``skip``
    left alone (already out for another reason)."""
    nodes = sorted(set(diagnosis.suspect_nodes) - set(skip))
    if not nodes or diagnosis.cls not in (*HARDWARE, "unknown"):
        return {}
    guess = diagnosis.cls == "unknown" or diagnosis.rule in LOST_PEER_RULES  # re-check decides
    if guess and recheck is None:
        return {}
    answers = recheck(nodes) if recheck is not None else {}
    base = f"diagnosis: {diagnosis.cls} failure ({diagnosis.symptom}): {diagnosis.summary}"
    out = {}
    for node in nodes:
        if node in answers:
            if answers[node] is not None:
                out[node] = f"re-check failed: {answers[node]}"[:300]
        elif diagnosis.cls in HARDWARE and not guess:
            unchecked = "; not re-checked" if recheck is not None else ""
            out[node] = f"{base}{unchecked}"[:300]
    return out
