"""The judgement of a diagnosis: the findings (`mscale.recover.diagnose.facts`) in, a
`Diagnosis` out. The finding of highest weight decides class, symptom and transience; the suspects
follow from the symptom (the hung rank for a hang, `mscale.recover.diagnose.hang`; the first
failed rank for a crash; nobody for a preemption, a NaN or a stop on request); the steps and the
exit code come from the records; the evidence lines are ordered and what many ranks said alike is
kept once. Nothing here raises on a damaged run directory.
"""

from __future__ import annotations

import math
import os
import re

from mscale.recover.decision import Diagnosis, Evidence
from mscale.recover.diagnose.facts import find
from mscale.recover.diagnose.findings import Hit
from mscale.recover.diagnose.hang import hung_ranks
from mscale.recover.diagnose.rules import NOTHING, Rule
from mscale.recover.diagnose.evidence import RunEvidence, collect, evidence_of

_KIND_PREFIX = re.compile(r"^(bad_input|disk_full|timeout|network|console|launcher_died|crash): ")
MAX_EVIDENCE = 20
"""Evidence lines kept, most telling first."""
SHAPE_CHARS = 200
"""Characters of a line's shape compared (evidence texts are cut at different lengths)."""
SOURCE_LOCATION = re.compile(r"\[[^\]\s]*:\d+\]\s*")
"""A C++ library's source location before its message (gloo: ``[/__w/…/pair.cc:553]``)."""
_NUMBERS = re.compile(r"0x[0-9a-f]+|\d+", re.IGNORECASE)
CONSEQUENCE = 15
"""Rules of this weight or less record what a peer saw when another rank went away."""
NO_SUSPECTS = ("none", "preemption", "numerics")
"""Classes that blame no rank or node (the node-failure line of SLURM excepted)."""
NO_NODE = ("disk_full", "damaged_checkpoint")
"""Storage symptoms that blame no rank or node: the run directory's filesystem is shared, every
node would meet the same full disk; a damaged checkpoint file has wrong bytes on disk (a
checksum, a size), which any node reading it would meet alike: the rank that read it is not
the culprit (a read *error*, ``Input/output error``, is not this symptom)."""


def diagnose(run_dir: str) -> Diagnosis:
    """Read ``run_dir`` and say what ended its last attempt (module docstring)."""
    ev = collect(run_dir)
    return decide(ev, find(ev))


def decide(ev: RunEvidence, hits: list[Hit]) -> Diagnosis:
    """The diagnosis from the findings: the heaviest decides, the earliest of equals first."""
    winner = max(hits, key=_strength) if hits else None
    rule = winner.rule if winner else NOTHING
    ranks, how = _suspects(ev, hits, rule)
    nodes = _nodes(ev, hits, rule, ranks)
    d = Diagnosis(cls=rule.cls, symptom=rule.symptom, summary="", suspect_ranks=ranks,
                  suspect_nodes=nodes, failed_step=_failed_step(ev), attempt=ev.attempt.number,
                  exit_code=_exit_code(ev, hits), transient=rule.transient, rule=rule.key)
    if rule.cls == "numerics":
        d.bad_step = _bad_step(hits, winner)
    if rule.key == "ckpt_damaged" and winner.checkpoint:
        d.damaged_checkpoint = _absolute(winner.checkpoint, ev.attempt.launch.get("cwd"))
        d.damaged_error = winner.checkpoint_error
    if rule.key == "slow_link" and not nodes:
        d.link_suspects = _link_suspects(ev)
    d.evidence = _evidence(ev, hits, rule, how)
    d.summary = _summary(d, rule, ev)
    return d


def unplaced_link(nodes: list[str]) -> str:
    """The verdict's line for a slow link on one of ``nodes`` that watch could not place."""
    listed = ", ".join(nodes)
    return (f"the slow link is on one of {listed} and the records cannot tell which: no node is "
            f"excluded for it. Before the relaunch, run `mscale preflight` with a plan over "
            f"{listed} and at least two more nodes (watch's advice) and exclude the node it "
            f"names, or the job runs as slowly again")


def _link_suspects(ev: RunEvidence) -> list[str]:
    """The nodes of the attempt's last slow-link finding that named none (its ``suspects``) and
    is still open: each finding's last record counts (watch records a finding that cleared,
    ``cleared`` in its evidence, actions.py), so a link that recovered is not named. A record
    without ``finding_key`` (an older watch's) is a finding of its own."""
    last: dict[str, dict] = {}
    for i, e in enumerate(ev.attempt.events):
        evd = e.get("evidence") if isinstance(e.get("evidence"), dict) else {}
        if e.get("source") == "watch" and evd.get("cause") == "slow_link":
            key = evd.get("finding_key")
            key = repr(key) if key is not None else f"#{i}"
            last.pop(key, None)
            last[key] = evd  # re-inserted: the dict keeps the order of each finding's last word
    out: list[str] = []
    for evd in last.values():
        names = evd.get("suspects")
        if evd.get("cleared") is not True and isinstance(names, list) \
                and all(isinstance(n, str) for n in names):
            out = list(names)
    return out


def _strength(h: Hit) -> tuple:
    when = h.time if isinstance(h.time, (int, float)) else math.inf
    return h.rule.weight, -when, -h.seq


def _suspects(ev: RunEvidence, hits: list[Hit], rule: Rule) -> tuple[list[int], str]:
    """The suspect ranks and how they were found."""
    if rule.symptom == "hang":
        return hung_ranks(ev, hits)
    if rule.cls in NO_SUSPECTS or rule is NOTHING or rule.symptom in NO_NODE \
            or rule.key == "console":
        return [], ""  # a full disk, a damaged file: shared storage; a closed terminal: nobody's
    if rule.weight <= CONSEQUENCE:  # peers lost a rank: the one that said nothing is suspect
        silent, how = hung_ranks(ev, hits)
        if silent and (ev.world is None or len(silent) < ev.world):
            return silent, how
    mine = sorted((h for h in hits if h.rule.key == rule.key and h.evidence.rank is not None),
                  key=_order)
    if rule.weight <= CONSEQUENCE:  # else the first to see it
        mine = mine[:1]
    ranks = list(dict.fromkeys(h.evidence.rank for h in mine))
    return ranks, "the rank(s) whose own evidence decided it" if ranks else ""


def _order(h: Hit) -> tuple:
    return (h.time if isinstance(h.time, (int, float)) else math.inf), h.seq


def _nodes(ev: RunEvidence, hits: list[Hit], rule: Rule, ranks: list[int]) -> list[str]:
    """The suspect ranks' nodes: as the deciding lines name them (srun's line names the real
    host), else by placement (`RunEvidence.node_of`); a SLURM node failure names its node."""
    said = {h.evidence.rank: h.evidence.node for h in hits
            if h.rule.key == rule.key and h.evidence.node and h.evidence.rank is not None}
    nodes = [n for r in ranks if (n := said.get(r) or ev.node_of(r))]
    if rule.cls not in NO_SUSPECTS and rule.symptom not in ("hang", *NO_NODE):  # a node only
        nodes += [h.evidence.node for h in hits if h.rule.key == rule.key
                  and h.evidence.rank is None and h.evidence.node]
    if rule.key == "slurm_node_fail":
        nodes += [m.group(1).rstrip(".,;") for h in hits if h.rule.key == rule.key
                  and (m := re.search(r"Node failure on (\S+)", h.evidence.text))]
    return sorted(set(nodes))


def _failed_step(ev: RunEvidence) -> int | None:
    """The last step completed: the newest metrics record, else the newest step an event of the
    attempt names."""
    if ev.last_metrics is not None:
        return int(ev.last_metrics["step"])
    steps = [s for e in ev.attempt.events if isinstance(s := e.get("step"), int)]
    return max(steps) if steps else None


def _bad_step(hits: list[Hit], winner: Hit) -> int | None:
    """The first bad step of the episode: the NaN's step, the divergence's first bad step, or
    the first of a run of gradient spikes when one led into it."""
    steps = [h.step for h in hits if h.rule.cls == "numerics" and isinstance(h.step, int)
             and h.rule.key in ("spikes", winner.rule.key)]
    if not isinstance(winner.step, int):
        return min(steps) if steps else None
    return min([winner.step, *[s for s in steps if s <= winner.step]])


def _exit_code(ev: RunEvidence, hits: list[Hit]) -> int | None:
    """The job's exit code as recorded: train's own stop carries it; a failure recorded by the
    launcher or a failing rank 0 means 3; else srun's ``Exited with exit code N``."""
    for e in reversed(ev.attempt.events):
        if e.get("source", "train") != "train" or e.get("kind") not in ("stop", "hang"):
            continue
        evd = evidence_of(e)
        if isinstance(evd.get("code"), int):
            return evd["code"]
        if "first_failed_rank" in evd or "error_file" in evd:
            return 3
    for h in hits:
        if h.rule.key == "exit_nonzero" and (m := re.search(r"exit code (\d+)",
                                                            h.evidence.text)):
            return int(m.group(1))
    return None


def _evidence(ev: RunEvidence, hits: list[Hit], rule: Rule, how: str) -> list[Evidence]:
    """Winning lines first, then the others by weight, then context and damaged files. The same
    line from many ranks (every peer's reset or timeout) is kept once, naming the other ranks
    that said it: per-rank lines differ only in ports, addresses and counters (`_shape`)."""
    ordered = sorted(hits, key=lambda h: (h.rule.key != rule.key, -h.rule.weight, _order(h)))
    out: list[Evidence] = []
    said: dict[str, tuple[Evidence, set]] = {}
    for e in [h.evidence for h in ordered] + _context(ev) + ev.problems:
        key = _shape(e.text) if e.rank is not None else _KIND_PREFIX.sub("", e.text)
        if key in said:
            said[key][1].add(e.rank)
            continue
        said[key] = (e, {e.rank})
        out.append(e)
    for first, ranks in said.values():
        first.also_ranks = sorted(r for r in ranks - {first.rank} if r is not None)
    if how and (rule.symptom == "hang" or rule.weight <= CONSEQUENCE):
        out.insert(1 if out else 0, Evidence(source="recover", text=f"suspect rank(s): {how}"))
    return out[:MAX_EVIDENCE]


def _shape(text: str) -> str:
    """A line with what differs between ranks saying the same thing taken out: the error kind's
    prefix, source locations (``[…/pair.cc:553]``), addresses, ports and numbers; cut short so
    that the same message cut at different lengths still matches."""
    text = SOURCE_LOCATION.sub("", _KIND_PREFIX.sub("", text))
    return _NUMBERS.sub("#", text)[:SHAPE_CHARS]


def _context(ev: RunEvidence) -> list[Evidence]:
    """What preflight, quarantine and unread flight-recorder dumps add."""
    out = []
    pf = ev.preflight or {}
    if pf.get("bad_nodes"):
        out.append(Evidence("preflight.json", f"preflight ({pf.get('status', '?')}) named bad "
                            f"nodes {', '.join(map(str, pf['bad_nodes']))}"))
    for entry in (ev.quarantine or {}).get("entries") or []:
        if isinstance(entry, dict) and entry.get("node"):
            out.append(Evidence("quarantine.json", f"{entry['node']} quarantined: "
                                f"{entry.get('reason', '')}"[:300], node=str(entry["node"])))
    for info, rank, doc in ev.flight:
        if doc is None:
            out.append(Evidence(info.source, "flight-recorder dump in pickle format: present, "
                                "not read (never unpickled); analyse it with torchfrtrace",
                                rank=rank))
    return out


def _absolute(path: str, cwd: object) -> str:
    """A checkpoint path as the failed job wrote it, made absolute against the job's working
    directory (its recorded launch) when it is a relative local path."""
    if "://" in path or os.path.isabs(path) or not isinstance(cwd, str) or not cwd:
        return path
    return os.path.normpath(os.path.join(cwd, path))


def _summary(d: Diagnosis, rule: Rule, ev: RunEvidence) -> str:
    what = rule.what[0].upper() + rule.what[1:]
    if d.damaged_checkpoint:
        what += f" ({d.damaged_checkpoint})"
    parts = [what]
    if d.suspect_ranks:
        where = f" on {', '.join(d.suspect_nodes)}" if d.suspect_nodes else ""
        parts.append(f"suspect rank(s) {', '.join(map(str, d.suspect_ranks))}{where}")
    elif d.suspect_nodes:
        parts.append(f"suspect node(s) {', '.join(d.suspect_nodes)}")
    if d.bad_step is not None:
        parts.append(f"first bad step {d.bad_step}")
    if d.failed_step is not None:
        parts.append(f"last completed step {d.failed_step}")
    if d.attempt is not None:
        parts.append(f"attempt {d.attempt}")
    return "; ".join(parts) + "."
