"""Measure the suspects again before anything is flagged: a node is excluded only for a figure
that is slow twice.

MegaScale runs self-check diagnostics on a suspect machine before it evicts it (docs/references.md,
"What MegaScale did"), and a 1,000-GPU job that loses a healthy node to one unlucky measurement
pays for it in hours. After the first round, rank 0 collects every rank, pair and group whose
figure was flagged (`suspects`) and broadcasts them; every rank measures them again under the
same conditions as the first time (`runner.measure_again`: the GEMM on every device at once, the
pairs and groups one at a time on CPUs, as in the first round); rank 0 judges the second round
against the first round's peers (`second_round_payloads`) and keeps, for each suspect, the less
severe of its two verdicts (`combine`), with both figures and their spread in the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mscale.config.preflight import CheckResult
from mscale.preflight import judge


@dataclass
class Suspects:
    """What the second round measures; sent from rank 0 to every rank (plain values)."""

    gemm: bool = False
    """Some device's GEMM was flagged: every device runs it again (they run it together, so
    measuring one alone would give it an idle machine its peers never had)."""
    pairs: list[tuple[str, int, int]] = field(default_factory=list)
    """(kind, a, b) of the flagged point-to-point pairs."""
    groups: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """(kind, members) of the groups with a flagged collective (all three are run again)."""

    def __bool__(self) -> bool:
        return self.gemm or bool(self.pairs) or bool(self.groups)

    def count(self) -> int:
        return int(self.gemm) + len(self.pairs) + len(self.groups)


def flagged(r: CheckResult) -> bool:
    return r.status in ("WARNING", "CRITICAL")


def suspects(results: list[CheckResult]) -> Suspects:
    """The flagged measurements of the first round (host checks are not measured twice)."""
    out = Suspects()
    pairs, groups = set(), set()
    for r in results:
        if not flagged(r):
            continue
        if r.check == "gemm":
            out.gemm = True
        elif r.entity_kind == "pair":
            pairs.add((r.evidence["kind"], r.ranks[0], r.ranks[1]))
        elif r.entity_kind == "group" and "op" in r.evidence:
            groups.add((r.evidence["kind"], tuple(r.ranks)))
    out.pairs, out.groups = sorted(pairs), sorted(groups)
    return out


def second_round_payloads(first: list[dict], second: list[dict]) -> list[dict]:
    """Every rank's payload with the re-measured figures in place of the first ones, so that
    the second figures are judged against the peers' first-round ones (measured the same way)."""
    out = []
    by_rank = {p["rank"]: p for p in second}
    for p in first:
        again = by_rank.get(p["rank"], {})
        redone_pairs = {(it["kind"], *it["ranks"]) for it in again.get("pairs", [])}
        redone_groups = {(it["kind"], tuple(it["ranks"])) for it in again.get("groups", [])}
        merged = dict(p)
        if "gemm" in again:
            merged["gemm"] = again["gemm"]
        merged["pairs"] = [it for it in p.get("pairs", [])
                           if (it["kind"], *it["ranks"]) not in redone_pairs] + again.get("pairs", [])
        merged["groups"] = [it for it in p.get("groups", [])
                            if (it["kind"], tuple(it["ranks"])) not in redone_groups
                            ] + again.get("groups", [])
        out.append(merged)
    return out


def combine(first: list[CheckResult], second: list[CheckResult]) -> list[CheckResult]:
    """First-round results, each flagged one replaced by the less severe of its two rounds."""
    again = {(r.check, r.entity): r for r in second}
    out = []
    for r in first:
        r2 = again.get((r.check, r.entity))
        if not flagged(r) or r2 is None:
            out.append(r)
            continue
        kept = r2 if judge.SEVERITY[r2.status] < judge.SEVERITY[r.status] else r
        values = [r.value, r2.value]
        spread = (abs(values[0] - values[1]) / max(values) if None not in values and max(values) > 0
                  else None)
        kept = kept.model_copy(deep=True)
        kept.evidence["rounds"] = {"values": values, "statuses": [r.status, r2.status],
                                   "spread": spread}
        if flagged(kept):
            kept.message += f" (slow in both rounds: {_fmt(values)} {r.unit})"
        else:
            kept.message += (f" — slow in the first round only ({_fmt(values)} {r.unit}): not "
                             "flagged")
        out.append(kept)
    return out


def _fmt(values: list[float | None]) -> str:
    return " then ".join("-" if v is None else f"{v:.4g}" for v in values)
