"""Which rank a hung job waited for, from the ranks' flight-recorder dumps.

Each dump says, for the rank that wrote it, the collectives it enqueued per process group
(sequence numbers count per group, the same on every member) and the last one it enqueued before
it failed: where it was blocked. A blocked rank waited for the members of that group that
  - left no dump (killed while stopped, or died),
  - had not enqueued that collective yet (their sequence number in the group is behind), or
  - enqueued it only after this rank's timeout had passed (a stopped rank continued by SLURM's
    SIGCONT, that arrived when its peers had given up).
Those are edges of a wait-for graph. Most waiting is a cascade (a rank stuck in its TP group
is behind in its DP group, so its DP peers wait for it): the culprits are the ranks waited for
that left no dump or arrived late; failing those, the ones behind that wait for nobody and did
not time out themselves (one that timed out waited for someone, perhaps in a transfer gloo does
not record; `culprits`).
Groups are compared by name: torch numbers ``pg_id`` per process.

The dumps come from `mscale.distributed.flight` (JSON, with each group's members) or from
torch's JSON dump (members in ``pg_config``, a group's count in ``pg_status``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Blocked:
    """The collective a rank enqueued last: where it was when it failed."""

    group: str
    seq: int
    created_ns: int | None
    timeout_ms: int | None


@dataclass
class RankFlight:
    """One rank's dump, as the comparison needs it."""

    seqs: dict[str, int] = field(default_factory=dict)
    """Process group name -> the last collective sequence number this rank enqueued in it."""
    created: dict[tuple[str, int], int] = field(default_factory=dict)
    """(group, sequence number) -> when this rank enqueued it (ns, its clock)."""
    blocked: Blocked | None = None
    p2p_last: bool = False
    """Its last entry is a point-to-point transfer: whom it waited for is not told here."""


def culprits(dumps: dict[int, dict], timed_out: set[int] | frozenset = frozenset()) -> list[int]:
    """The ranks the others waited for, by the dumps of the ranks that wrote one (rank -> the
    dump's JSON object); [] when the dumps do not tell. ``timed_out``: the ranks whose own error
    was a timeout.

    A rank waited for that left no dump or arrived late is named on evidence of its own, and
    then only those are. Otherwise the ranks behind that wait for nobody are, less those that
    timed out: a rank's last recorded collective is not always where it was blocked (gloo
    records no point-to-point transfer, so a pipeline stage waiting for its neighbour's
    activations looks like a rank that waits for nobody), and one that timed out was waiting.
    A rank stopped and continued (SLURM's SIGCONT) fails on a lost peer, not a timeout."""
    flights = {r: parse(doc) for r, doc in dumps.items()}
    members = group_members(dumps.values())
    edges = {r: waits_for(r, f, flights, members) for r, f in flights.items()}
    waited = {m: why for waits in edges.values() for m, why in waits.items()}
    seen = {m for m, why in waited.items() if why != BEHIND}  # its own evidence: no dump, late
    roots = seen or {m for m in waited if not edges.get(m) and not flights[m].p2p_last
                     and m not in timed_out}
    if roots or any(f.blocked or f.p2p_last for f in flights.values()):
        return sorted(roots)
    return sorted(_behind(flights))  # counts alone (torch's dumps without entries)


ABSENT, BEHIND, LATE = "absent", "behind", "late"
"""Why a rank waited for a member: it left no dump, had not enqueued the collective yet, or
enqueued it after the waiting rank's timeout."""


def waits_for(rank: int, f: RankFlight, flights: dict[int, RankFlight],
              members: dict[str, list[int]]) -> dict[int, str]:
    """The members of the group ``rank`` was blocked in that it waited for, and why (module
    docstring)."""
    b = f.blocked
    if b is None or f.p2p_last or b.group not in members:
        return {}
    out = {}
    for m in members[b.group]:
        if m == rank:
            continue
        other = flights.get(m)
        if other is None:
            out[m] = ABSENT
            continue
        seq = other.seqs.get(b.group)
        if seq is not None and seq < b.seq:
            out[m] = BEHIND
        elif seq == b.seq and _late(other.created.get((b.group, b.seq)), b):
            out[m] = LATE
    return out


def _late(created_ns: int | None, b: Blocked) -> bool:
    """Enqueued after ``b``'s rank had waited its whole timeout for it."""
    if created_ns is None or b.created_ns is None or not b.timeout_ms:
        return False
    return created_ns > b.created_ns + b.timeout_ms * 1_000_000


def _behind(flights: dict[int, RankFlight]) -> set[int]:
    """Ranks whose count in a group is below another member's: all that dumps without entries
    (only ``pg_status``) tell. With entries the graph decides: a rank behind in one group may
    be stuck in another, behind the rank everyone waited for."""
    by_group: dict[str, dict[int, int]] = {}
    for r, f in flights.items():
        for g, n in f.seqs.items():
            by_group.setdefault(g, {})[r] = n
    out: set[int] = set()
    for counts in by_group.values():
        if len(counts) > 1:
            newest = max(counts.values())
            out |= {r for r, n in counts.items() if n < newest}
    return out


def parse(doc: dict) -> RankFlight:
    """The parts of one dump the comparison reads; anything malformed is left out."""
    f = RankFlight()
    ids: dict[str, str] = {}
    entries = doc.get("entries")
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict):
            continue
        group = _group_name(e)
        if e.get("is_p2p") is True:
            f.p2p_last = group is not None
            continue
        seq = _int(e.get("collective_seq_id"))
        if group is None or seq is None:
            continue
        f.p2p_last = False
        if (pg_id := _int(e.get("pg_id"))) is not None:
            ids[str(pg_id)] = group
        created = _int(e.get("time_created_ns"))
        if created is not None:
            f.created[(group, seq)] = created
        f.seqs[group] = max(seq, f.seqs.get(group, seq))
        f.blocked = Blocked(group, seq, created, _int(e.get("timeout_ms")))
    status = doc.get("pg_status")
    for pg, st in status.items() if isinstance(status, dict) else []:
        group = ids.get(pg, pg if pg == "0" or not ids else None)  # "0": the default group
        n = _int(st.get("last_enqueued_collective")) if isinstance(st, dict) else None
        if group is not None and n is not None:
            f.seqs[group] = max(n, f.seqs.get(group, n))
    return f


def group_members(docs) -> dict[str, list[int]]:
    """Group name -> its members' global ranks, from every dump (ours: ``mscale_groups``;
    torch's: ``pg_config``, ranks as a list or as its JSON text)."""
    from mscale.distributed.flight import GROUPS_KEY

    out: dict[str, list[int]] = {}
    for doc in docs:
        ours = doc.get(GROUPS_KEY)
        for name, ranks in ours.items() if isinstance(ours, dict) else []:
            if _ranks(ranks):
                out[str(name)] = _ranks(ranks)
        config = doc.get("pg_config")
        for name, cfg in config.items() if isinstance(config, dict) else []:
            ranks = _ranks(cfg.get("ranks")) if isinstance(cfg, dict) else []
            if ranks:
                out.setdefault(str(cfg.get("name", name)), ranks)
    return out


def _ranks(value) -> list[int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if not isinstance(value, list):
        return []
    ranks = [_int(v) for v in value]
    return sorted(r for r in ranks if r is not None)


def _group_name(e: dict) -> str | None:
    pg = e.get("process_group")
    name = pg[0] if isinstance(pg, list) and pg else None
    return name if isinstance(name, str) and name else None


def _int(value) -> int | None:
    """A number as a dump writes it: a number, or its text (torch's JSON dump writes both)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None
