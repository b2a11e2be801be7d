"""Name the hung rank: the one that stopped answering, not the peers that timed out on it.

A SIGSTOPped or deadlocked rank never times out itself; every peer that waits for it does, and
writes an error file saying so. In order of trust:

1. the launcher's ``hang`` event (``--local``: it saw which workers were still running, or
   stopped, when the first timeout came);
2. flight-recorder dumps: the rank the others waited for, that waited for nobody itself
   (`flight.culprits`: it never joined the collective its peers were in, joined it only after
   they had timed out, or left no dump);
3. the ranks of the plan that wrote no timeout or network error file in this attempt, and of
   those, the one whose log went quiet first (oldest modification time, then the least
   written): the rank that logged least and last.
"""

from __future__ import annotations

from mscale.recover.diagnose import flight
from mscale.recover.diagnose.findings import Hit
from mscale.recover.diagnose.evidence import RunEvidence

QUIET_GAP_S = 1.0
"""Log times closer than this do not tell two ranks apart (files are created together)."""
PEER_KINDS = ("timeout", "network")
"""Error-file kinds a rank writes when it waited for a peer that never came."""
EVERY_RANK_WAITED = (
    "every rank timed out, so their error files cannot tell which one the others waited for (a "
    "stopped rank times out too once it is continued: SLURM sends SIGCONT before its SIGTERM); "
    "the flight-recorder dumps under RUN/logs/ would, and these did not (docs/recover.md, "
    "\"What it reads, and how much\")")
"""Why no rank is named when every rank wrote a timeout or network error file."""


def hung_ranks(ev: RunEvidence, hits: list[Hit]) -> tuple[list[int], str]:
    """The hung ranks and how they were found (one phrase for the evidence)."""
    for h in hits:
        if h.rule.key == "hang" and h.ranks:
            return sorted(h.ranks), "named by the launcher"
    waited = {r for r, rec in ev.error_files.items() if rec.get("kind") in PEER_KINDS}
    named = flight_culprits(ev)
    if named:
        return named, "the rank its peers waited for, by the flight recorder"
    world = ev.world
    if world is None:
        return [], "no plan to tell the silent ranks"
    silent = [r for r in range(world) if r not in waited]
    if not waited:
        return [], "no rank timed out waiting for another"
    if not silent:
        return [], EVERY_RANK_WAITED
    if len(silent) == 1:
        return silent, "the one rank that did not time out waiting"
    quiet = quietest(ev, silent)
    return ([quiet], "the silent rank whose log went quiet first") if quiet is not None \
        else (silent, "the ranks that did not time out waiting")


def quietest(ev: RunEvidence, ranks: list[int]) -> int | None:
    """Of ``ranks``, the one whose log went quiet first (its last write the oldest by
    `QUIET_GAP_S`; among logs as old, the shortest); None when their logs do not tell."""
    logs = [(ev.logs[r].mtime or 0.0, ev.logs[r].size, r) for r in ranks if r in ev.logs]
    if not logs or len(logs) < len(ranks):
        return None
    oldest = min(t for t, _, _ in logs)
    near = [(size, r) for t, size, r in logs if t - oldest < QUIET_GAP_S]
    least = min(size for size, _ in near)
    fewest = [r for size, r in near if size == least]
    return fewest[0] if len(fewest) == 1 else None


def flight_culprits(ev: RunEvidence) -> list[int]:
    """The ranks this attempt's flight-recorder dumps say the others waited for."""
    dumps = {rank: doc for _, rank, doc in ev.flight if doc}
    timed_out = {r for r, rec in ev.error_files.items() if rec.get("kind") == "timeout"}
    return flight.culprits(dumps, timed_out) if dumps else []
