"""A preflight's records in the job's key-value store (torch.distributed's store, served from
rank 0's process): which ranks finished each phase, each rank's figures so far, what a rank saw
fail, each rank's node; and rank 0's reading of them once its own collective failed
(`runner._when_stopped`, then `stopped.failure_report`).

Rank 0 reads them after the operator's ``--timeout`` has already expired, so the reading must
cost few round trips. A key per rank cost about six round trips a rank (two to learn whether it
answered, then a check and a get for its figures and for its stop): ~25,000 at 4,096 ranks,
most of the read-back's time. So each rank also appends itself to one list per kind (``done/``
a phase, ``failed``, ``nodes``: `_listed`), which rank 0 reads in one ``multi_get`` a poll,
and the records of the ranks listed are fetched ``CHUNK`` at a time: 5 round trips, then 2 per
``CHUNK`` ranks (37 at 4,096 ranks, 101 at 12,288: docs/benchmarks.md, "preflight: reading a
stopped run back"). The lists are exact sets of ranks: a rank that finished the phase and then
failed in the next one is one rank that answered, not two, and rank 0's own marks are not an
answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

KEY = "mscale-preflight"
CHUNK = 256
"""Records fetched per ``multi_get``: one answer of a few hundred kilobytes (a payload is a few
kilobytes), not the whole world's figures in one message."""
POLL_S = 0.2
"""How often rank 0 reads the lists while it waits for the other ranks to answer."""


def store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()  # noqa: SLF001 - the job's own store


def _listed(name: str) -> str:
    return f"{KEY}/ranks/{name}"


def register(rank: int, node: str) -> None:
    """This rank's node, for a report that must name the node of a rank that never answered."""
    store().append(_listed("nodes"), f"{rank} {node}\n")


def mark(phase: str, rank: int, payload: dict | None = None) -> None:
    """This rank finished ``phase``, and (``payload``) what it has measured so far: if a later
    collective fails, rank 0 reports it from here."""
    s = store()
    if payload is not None:
        s.set(f"{KEY}/payload/{rank}", json.dumps(payload))
    # listed only once its figures are set: a rank rank 0 finds listed has a record to read
    # (multi_get waits, up to the store's timeout, for a key that is not there)
    s.append(_listed(f"done/{phase}"), f"{rank},")


def mark_failed(payload: dict, rank: int, record: dict) -> None:
    """This rank saw its phase fail (``record``: `runner.stop_record`): it is alive, and not
    the one the others waited for. Its figures so far go to rank 0 with it."""
    s = store()
    s.set(f"{KEY}/payload/{rank}", json.dumps(payload))
    s.set(f"{KEY}/failed/{rank}", json.dumps(record))
    s.append(_listed("failed"), f"{rank},")


@dataclass
class Answers:
    """One reading of the lists: the ranks that finished the phase rank 0 stopped in, those
    that said they saw a failure, those that left figures (every rank's first mark, 'start',
    carries them: `runner.measure`), and each registered rank's node."""

    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    measured: set[int] = field(default_factory=set)
    nodes: dict[int, str] = field(default_factory=dict)

    def answered(self, world: int) -> set[int]:
        """The ranks other than rank 0 that answered (rank 0's own marks are not an answer)."""
        return {r for r in self.done | self.failed if 0 < r < world}

    def lost(self, world: int) -> list[int]:
        """The ranks that neither finished the phase nor said they saw it fail."""
        answered = self.answered(world)
        return [r for r in range(1, world) if r not in answered]


def answers(phase: str, world: int, grace_s: float) -> Answers:
    """The lists, once every other rank answered or after ``grace_s``: the peers that saw the
    same failure say so within about the same timeout, so rank 0 waits for them first."""
    s = store()
    keys = [_listed(f"done/{phase}"), _listed("failed"), _listed("done/start"),
            _listed("nodes")]
    for k in keys:  # an empty list where nobody wrote one: multi_get would wait for it
        s.append(k, "")
    deadline = time.monotonic() + grace_s
    while True:
        done, failed, started, nodes = (v.decode(errors="replace") for v in s.multi_get(keys))
        seen = Answers(_ranks(done), _ranks(failed), _ranks(started) | _ranks(failed),
                       _nodes(nodes))
        if len(seen.answered(world)) >= world - 1 or time.monotonic() >= deadline:
            return seen
        time.sleep(POLL_S)


def missing_ranks(phase: str, world: int, grace_s: float = 10.0) -> list[int]:
    """Ranks that neither finished ``phase`` nor reported its failure: the dead and the hung."""
    return answers(phase, world, grace_s).lost(world)


def records(kind: str, ranks: list[int]) -> dict[int, dict]:
    """Rank → its ``kind`` record (``payload``, ``failed``), for ranks listed as having one.
    An unreadable record or batch is left out: one rank's record is not the report's end."""
    s = store()
    out: dict[int, dict] = {}
    for i in range(0, len(ranks), CHUNK):
        part = ranks[i:i + CHUNK]
        try:
            got = s.multi_get([f"{KEY}/{kind}/{r}" for r in part])
        except Exception:  # noqa: BLE001 - the store may be gone with the peers
            continue
        for r, raw in zip(part, got):
            try:
                out[r] = json.loads(raw)
            except ValueError:
                continue
    return out


def _ranks(text: str) -> set[int]:
    return {int(t) for t in text.split(",") if t.strip().isdigit()}


def _nodes(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        rank, _, node = line.partition(" ")
        if rank.isdigit() and node:
            out[int(rank)] = node
    return out
