"""Which nodes a relaunch keeps out, each with its reason.

Three sources, each trusted for what it can know:

1. ``quarantine.json``: entries still in force at ``now`` (no expiry, or not expired). Watch
   (a hardware straggler) and operators write it; an expired entry is a node back in the pool.
2. ``preflight.json``: nodes a CRITICAL check blamed, but only when that preflight ran for the
   run's plan (same world and tp/pp/dp as ``RUN/plan.yaml``): a report for another layout tested
   other groups. Its ``bad_nodes`` also repeat quarantine.json's entries of the day; those are
   judged by rule 1 (so an expired one does not come back through preflight). And only when it
   speaks of the failed attempt (`about_attempt`): written no earlier than `PREFLIGHT_LEAD_S`
   before the attempt's start (the job's own preflight, just before train), and for the nodes
   the attempt ran on. An older report, or one without a time, measured the nodes some other
   day: a node repaired since would stay out for good. What is passed over is said in
   ``Exclusions.notes``.
3. the diagnosis: suspect nodes when the failure class is hardware (``gpu``, ``network``).
   With a ``recheck`` (preflight run again on the suspects, `recover.recheck`), a suspect that
   re-checks healthy stays in, one that fails is out with the re-check's reason, and one the
   re-check could not reach is out on the diagnosis. For class ``unknown``, and for a network
   failure known only as a lost peer or a timeout (`LOST_PEER_RULES`: what every rank sees
   when another is killed, under torchrun with no other word of it), only a failed re-check
   excludes (a measured fault is evidence enough; a guess is not): a SIGKILLed torchrun worker
   cost its node, and on one node the whole run. A NCCL/InfiniBand error stays firm. Software,
   numerics, user code, preemption and storage failures never exclude nodes: another node
   would fail the same way, and every exclusion costs capacity for the rest of the run.

Besides these, the nodes the job itself already keeps out (its command's ``--exclude``, its
allocation's) stay out of the relaunch; `with_carried` adds those that cost it a node, so that
the re-plan counts only nodes it may use, and `released` names those quarantine let go.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import replace

from mscale.config.base import load_json_model, load_model
from mscale.config.plan import Plan
from mscale.config.preflight import PreflightReport
from mscale.config.records import QUARANTINE_FIX, Quarantine, QuarantineEntry
from mscale.hostlist import collect_hostlist, expand_hostlist
from mscale.recover.decision import Diagnosis, Exclusions
import mscale.recover.diagnose.read as rd
from mscale.recover.diagnose.evidence import Attempt, last_attempt
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir
from mscale.topology.placement import placement_for

HARDWARE = ("gpu", "network")
"""Failure classes whose suspects are kept out."""
LOST_PEER_RULES = ("peer_gone", "collective_timeout", "network", "timeout")
"""Diagnosis rules (diagnose/rules.py) that see a peer go away, not the network fail."""
PREFLIGHT_LEAD_S = 1800.0
"""How long before an attempt's start its preflight.json still speaks of it. The job script of
docs/recover.md runs preflight on its allocation just before train: a full preflight and train's
start-up (process groups, the model) take minutes, not half an hour. A report older than that
was written for an earlier job, whatever nodes it shares with this one."""

QUARANTINED = "quarantine.json"
"""How the reason of a node `quarantined` keeps out begins; an earlier recovery's decision
document says by it which of the nodes it kept out quarantine held (`released`)."""
_DECISION = re.compile(r"decision-(\d{4,})\.json$")

Recheck = Callable[[list[str]], dict[str, "str | None"]]
"""node list → node → failure reason, or None when healthy; unreachable nodes absent."""


def decide_exclusions(run: RunDir, diagnosis: Diagnosis, recheck: Recheck | None = None,
                      now: float | None = None, plan: Plan | None = None,
                      ran: list[str] | None = None,
                      kept: dict[str, str] | None = None) -> Exclusions:
    """The nodes to keep out and why (module docstring for the rules). ``plan``: the run's
    plan.yaml when the caller has already loaded it (a 12,288-rank plan is not parsed again);
    else it is read here, if there is one. ``ran``: the nodes the failed attempt ran on, in
    placement order, as its start event recorded them (SLURM's names under srun): a quarantine
    entry by the plan's name is read as SLURM's (`slurm_names`). ``kept``: node → why, the
    nodes the job itself already keeps out (`relaunch.carried_exclusions`, less those released):
    a suspect among them is not re-checked, and one line of ``notes`` says so."""
    now = time.time() if now is None else now
    reasons: dict[str, str] = {}
    notes: list[str] = []
    plan = plan if plan is not None else _run_plan(run)
    # the nodes the attempt ran on (SLURM's names); the plan's stand in only when unknown: a
    # plan name outside the allocation (node[1-4] planned, node[5-8] given) is not the run's
    ours = set(ran) if ran else (set(plan.cluster.node_names()) if plan is not None else None)
    for node, why in quarantined(run, now, slurm_names(plan, ran)).items():
        if ours is not None and node not in ours:  # still kept out of a new allocation
            why += " (not one of the run's nodes: only a new allocation avoids it)"
        reasons.setdefault(node, why)
    for node, why in preflight_bad(run, notes, plan).items():
        reasons.setdefault(node, why)
    # a suspect already kept out is not re-checked: a preflight on a node with a degraded link
    # is slow (minutes under SLURM) and could not bring it back anyway
    kept = {n: why for n, why in (kept or {}).items() if n not in reasons}
    for node, why in suspects(diagnosis, recheck, skip={*reasons, *kept}, notes=notes,
                              kept=kept).items():
        reasons.setdefault(node, why)
    return Exclusions(nodes=sorted(reasons), reasons={n: reasons[n] for n in sorted(reasons)},
                      notes=notes)


def slurm_names(plan: Plan | None, ran: list[str] | None) -> dict[str, str]:
    """The plan's name → SLURM's name of each node the failed attempt ran on, where they differ
    (``gpu[01-04]`` planned, ``node[1-4]`` given): a watch that named nodes by the plan (one
    older than its naming by the start event) quarantined a node by the plan's name; SLURM, the
    re-plan and the relaunch's ``--exclude`` know it by its own. Applied to watch's entries
    alone (`_slurm_name`). Empty when the names agree, when the attempt's nodes are not known in
    placement order, or when a plan name is also one of the attempt's nodes (``node[1-4]``
    planned, ``node[2-5]`` given): such a name could mean either node."""
    if plan is None or not ran:
        return {}
    planned = plan.cluster.node_names()[: placement_for(plan).num_nodes]
    if len(planned) != len(ran) or set(planned) & set(ran):
        return {}
    return dict(zip(planned, ran))


def _run_plan(run: RunDir) -> Plan | None:
    """The run's plan.yaml, None without one (checked elsewhere: the diagnosis)."""
    return load_model(Plan, run.plan) if _exists(run.plan) else None


def _exists(url: str) -> bool:
    fs, path = fs_and_path(url)
    return fs.isfile(path)


def quarantined(run: RunDir, now: float,
                names: dict[str, str] | None = None) -> dict[str, str]:
    """Nodes quarantine.json keeps out at ``now``, with its reason; an entry watch wrote by a
    plan name in ``names`` (`slurm_names`) keeps out the node SLURM knows by the other name."""
    out = {}
    for e in _entries(run):
        if e.expires is None or e.expires > now:
            until = "until cleared" if e.expires is None else f"until {_when(e.expires)}"
            node = _slurm_name(e, names)
            alias = f" (entered as {e.node}, the plan's name for {node})" if node != e.node \
                else ""
            out.setdefault(node, f"{QUARANTINED} ({until}): {e.reason}{alias}"[:300])
    return out


_BY_WATCH = "watch: "
"""How the reason of an entry watch wrote begins (watch/actions.py `_quarantine_now`)."""


def _slurm_name(e: QuarantineEntry, names: dict[str, str] | None) -> str:
    """The node entry ``e`` keeps out. Only watch ever wrote a plan's name (before it named
    nodes by the start event's ``launch.nodes``); an entry written by hand names the node as
    SLURM knows it (`QuarantineEntry.node`), and a plan's name can be a real node outside the
    allocation (``node[1-4]`` planned, ``node[5-8]`` given: node2 entered by hand is node2, not
    node6)."""
    return (names or {}).get(e.node, e.node) if e.reason.startswith(_BY_WATCH) else e.node


def _entries(run: RunDir) -> list[QuarantineEntry]:
    if not _exists(run.quarantine):
        return []
    return load_json_model(Quarantine, run.quarantine, fix=QUARANTINE_FIX).entries


def released(run: RunDir, now: float, names: dict[str, str] | None = None) -> list[str]:
    """Nodes quarantine kept out once and no longer holds at ``now``: back in the pool, so a
    relaunch drops them from the exclusions the job's command or allocation still carries (an
    earlier recovery put them there). Once kept out: an entry in quarantine.json (all of its
    entries expired: watch quarantines for 24 h by default), or a node an earlier recovery kept
    out for its quarantine (`quarantined_before`) that has no entry left: an operator cleared
    it by hand, or removed the file (QUARANTINE_FIX: that releases every node). A node the job
    kept out for its own reasons, never quarantined, is not released; nor is one an earlier
    recovery already let back (`let_back`) that no quarantine entry has named since: it is in
    the job's exclusions again because an operator put it there after that, and the latest word
    is theirs. ``names``: as for `quarantined`."""
    names = names or {}
    held = set(quarantined(run, now, names))
    entries = _entries(run)
    listed = {_slurm_name(e, names) for e in entries}
    again = {n for n, when in let_back(run).items()
             if not any(_slurm_name(e, names) == n and e.since > when for e in entries)}
    return sorted((listed | quarantined_before(run)) - held - again)


def _decisions(run: RunDir) -> list[dict]:
    """Earlier recoveries' decision documents (``RUN/recover/decision-NNNN.json``), oldest
    first by number; one that cannot be read is passed over."""
    out = []
    for info in sorted((i for i in rd.listing(run.root, "recover", maxdepth=1)
                        if _DECISION.search(i.source)), key=_decision_number):
        try:
            doc = rd.read_json(info)
        except rd.Problem:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def quarantined_before(run: RunDir) -> set[str]:
    """The nodes earlier recoveries kept out because quarantine.json held them, as their
    decision documents give the reasons; the latest one to keep a node out decides (a node back
    from quarantine that failed again was kept out on its diagnosis: it stays out), and one
    that let the node back ends it (`let_back`)."""
    out: set[str] = set()
    for doc in _decisions(run):
        ex = doc.get("exclusions") if isinstance(doc.get("exclusions"), dict) else {}
        reasons = ex.get("reasons")
        for node, why in (reasons.items() if isinstance(reasons, dict) else ()):
            if isinstance(why, str) and why.startswith(QUARANTINED):
                out.add(node)
            else:
                out.discard(node)
        out -= set(_names(ex.get("released")))
    return out


def let_back(run: RunDir) -> dict[str, float]:
    """node → when the latest recovery that let it back decided so: the nodes an earlier
    recovery dropped from the job's own exclusions because quarantine released them
    (``exclusions.released`` of its decision document, and its ``time``; 0 without one)."""
    out: dict[str, float] = {}
    for doc in _decisions(run):
        ex = doc.get("exclusions") if isinstance(doc.get("exclusions"), dict) else {}
        when = doc.get("time")
        for node in _names(ex.get("released")):
            out[node] = float(when) if isinstance(when, (int, float)) else 0.0
    return out


def _names(value) -> list[str]:
    return [n for n in value if isinstance(n, str)] if isinstance(value, list) else []


def _decision_number(info: rd.FileInfo) -> int:
    return int(_DECISION.search(info.source).group(1))


def with_carried(exclusions: Exclusions, carried: dict[str, str], released: list[str],
                 ran: list[str] | None) -> Exclusions:
    """``exclusions`` with the nodes the job already kept out (``carried``: node → why, from its
    command or allocation; `relaunch.carried_exclusions`) that cost the relaunch a node, so the
    re-plan counts only what it may use: not ``released`` (the relaunch lets them back: they
    are recorded as ``released``, so that a later recovery knows they were), not this
    recovery's own (their reason says more), and among the nodes the failed attempt ran on
    (``ran``; any when unknown). A node the attempt did not run on took no place of the plan:
    an allocation need not hold the plan's names (docs/slurm.md), so the plan's name stood for
    another machine, and the relaunch has as many without it."""
    out, ran_on = set(released) | set(exclusions.nodes), None if not ran else set(ran)
    kept = {n: why for n, why in sorted(carried.items())
            if n not in out and (ran_on is None or n in ran_on)}
    back = sorted(n for n in carried if n in set(released) and n not in exclusions.nodes)
    return replace(exclusions, carried=kept, released=back)


def preflight_bad(run: RunDir, notes: list[str] | None = None,
                  plan: Plan | None = None) -> dict[str, str]:
    """Nodes a CRITICAL preflight check blamed, when preflight ran for the run's plan (``plan``,
    else read from the run) and of its failed attempt (`about_attempt`); the bad nodes passed
    over are said in ``notes``."""
    plan = plan if plan is not None else _run_plan(run)
    if not _exists(run.preflight) or plan is None:
        return {}
    report = load_model(PreflightReport, run.preflight)  # a record: NaN is a measurement
    if not ran_for(report, plan):
        return {}
    bad = blamed(report)
    if not bad:
        return {}
    events, _ = rd.read_jsonl_tail(run.events, rd.JSONL_TAIL_BYTES)  # as the diagnosis reads
    return about_attempt(report, bad, last_attempt(events), [] if notes is None else notes)


def blamed(report: PreflightReport) -> dict[str, str]:
    """Node → the CRITICAL result ``report`` blames it for, for the nodes in its bad_nodes."""
    out = {}
    for r in report.results:
        # a quarantine entry preflight repeated is quarantine.json's to judge (it may have
        # expired or been cleared since): it never comes back through preflight.json
        if r.check == "quarantine":
            continue
        if r.status == "CRITICAL" and r.node and r.node in report.bad_nodes:
            out.setdefault(r.node, f"preflight.json: {r.check} on {r.entity}: {r.message}"[:300])
    return out


def about_attempt(report: PreflightReport, bad: dict[str, str], attempt: Attempt,
                  notes: list[str]) -> dict[str, str]:
    """``bad`` (node → why, from ``report``) less what is not evidence about ``attempt``: all of
    it when the report predates the attempt or has no time (`stale`), else the nodes the attempt
    did not run on (a report of another allocation judged other machines). Each cut is one
    sentence in ``notes``: an operator must see why a node named bad is not kept out."""
    why = stale(report, attempt)
    if why:
        notes.append(f"{why}: its bad nodes ({collect_hostlist(sorted(bad))}) are not used")
        return {}
    ran = attempt_nodes(attempt)
    other = sorted(n for n in bad if ran is not None and n not in ran)
    if other:
        notes.append(f"preflight.json's bad nodes {collect_hostlist(other)} are not among "
                     f"attempt {attempt.number}'s nodes: not used")
    return {n: why for n, why in bad.items() if n not in other}


def stale(report: PreflightReport, attempt: Attempt) -> str | None:
    """Why ``report`` does not speak of ``attempt`` (one clause), None when it may: written no
    earlier than `PREFLIGHT_LEAD_S` before the attempt began. A report without a time is of
    unknown age (mscale's preflight always wrote one: another tool, or a hand, wrote this one; a
    file's mtime is no stand-in, a copy of the run directory renews it). A run that recorded no
    attempt has nothing a report could predate."""
    began = attempt_began(attempt)
    if began is None:
        return None
    of = f"attempt {attempt.number} (started {'' if attempt.start else 'after '}{_when(began)})"
    when = report_time(report)
    if when is None:
        return f"preflight.json has no time (unknown age), so it cannot be dated against {of}"
    if when < began - PREFLIGHT_LEAD_S:
        return f"preflight.json from {_when(when)} predates {of}"
    return None


def report_time(report: PreflightReport) -> float | None:
    """When ``report`` was written; None when its file had no ``time`` (the model's default is
    the time of reading, which would pass any old file for a fresh one)."""
    return report.time if "time" in report.model_fields_set else None


def attempt_began(attempt: Attempt) -> float | None:
    """Its start event's time; when it failed before writing one, the previous attempt's end
    (it began after that); None when the run recorded neither."""
    t = (attempt.start or {}).get("time")
    return float(t) if isinstance(t, (int, float)) else attempt.begins


def attempt_nodes(attempt: Attempt) -> set[str] | None:
    """The nodes ``attempt`` ran on, as preflight names them: SLURM's node list (with the plan's
    names) under SLURM, the plan's names under ``--local``; None when not known (torchrun records
    only the plan's names, and preflight there names hosts)."""
    launch, nodes = attempt.launch, attempt.launch.get("nodes")
    names = {str(n) for n in nodes if n} if isinstance(nodes, list) else set()
    slurm = launch.get("slurm")
    if isinstance(slurm, dict) and isinstance(slurm.get("nodelist"), str):
        try:
            return names | set(expand_hostlist(slurm["nodelist"]))
        except ValueError:  # a damaged record: the names it has
            return names or None
    return names if attempt.launcher == "local" and names else None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def ran_for(report: PreflightReport, plan: Plan) -> bool:
    """True when ``report`` tested ``plan``'s groups: same world and tp/pp/dp."""
    lay = plan.layout
    return (report.world == lay.world_size
            and report.layout == {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp})


def suspects(diagnosis: Diagnosis, recheck: Recheck | None,
             skip: set[str] = frozenset(), notes: list[str] | None = None,
             kept: dict[str, str] | None = None) -> dict[str, str]:
    """The diagnosis's suspect nodes to keep out (rule 3 of the module docstring), ``skip``
    left alone (already out for another reason). A suspect the job itself already keeps out
    (``kept``: node → why) is not re-checked either: one line of ``notes`` says so."""
    nodes = sorted(set(diagnosis.suspect_nodes) - set(skip))
    if diagnosis.cls not in (*HARDWARE, "unknown"):
        return {}
    for node in sorted(set(diagnosis.suspect_nodes) & set(kept or {})):
        if notes is not None:
            notes.append(f"suspect {node} not re-checked: already {kept[node]}")
    if not nodes:
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
