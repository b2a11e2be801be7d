"""A finding (`Hit`: a rule of `mscale.recover.diagnose.rules` and the evidence line that matched
it) and the list the readers of `facts` and `slurm` add to (`Findings`).

Its own module so that every reader of evidence can add findings without importing the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mscale.recover.decision import Evidence
from mscale.recover.diagnose.evidence import RunEvidence
from mscale.recover.diagnose.rules import (FACT_RULES, TEXT_RULES, XID_APPLICATION, XID_NUMBER,
                                           Rule)

_ANY_TEXT_RULE = re.compile("|".join(f"(?:{r.pattern.pattern})" for r in TEXT_RULES),
                            re.IGNORECASE)


@dataclass
class Hit:
    """One finding: a rule and the evidence line that matched it."""

    rule: Rule
    """What the evidence means."""
    evidence: Evidence
    """The line, where it was read, and the rank and node it concerns."""
    time: float | None = None
    """When it was written (Unix time), when known: ties of weight go to the earliest."""
    step: int | None = None
    """The training step it names (a NaN's step, a divergence's first bad step)."""
    seq: int = 0
    """Reading order (ties of weight and time go to the first read)."""
    ranks: tuple[int, ...] = ()
    """Ranks it names (a hang event's hung ranks), beyond ``evidence.rank``."""
    checkpoint: str | None = None
    """The checkpoint directory a ``ckpt_damaged`` finding names, as the error wrote it."""
    checkpoint_error: str | None = None
    """What the read said of that checkpoint (the message without its fix)."""


class Findings:
    """The hits found so far, in reading order."""

    def __init__(self, ev: RunEvidence):
        self.ev = ev
        self.hits: list[Hit] = []

    def add(self, key_or_rule: str | Rule, source: str, text: str, rank: int | None = None,
            time: float | None = None, step: int | None = None, ranks=()) -> Hit:
        rule = FACT_RULES[key_or_rule] if isinstance(key_or_rule, str) else key_or_rule
        node = self.ev.node_of(rank)
        hit = Hit(rule, Evidence(source=source, text=" ".join(text.split())[:300], rank=rank,
                                 node=node), time, step, len(self.hits), tuple(ranks))
        self.hits.append(hit)
        return hit

    def text(self, source: str, line: str, rank: int | None = None,
             time: float | None = None) -> None:
        """Every text rule ``line`` matches (one hit per rule)."""
        if not _ANY_TEXT_RULE.search(line):
            return
        for rule in TEXT_RULES:
            if rule.pattern.search(line):
                if rule.key == "xid" and (m := XID_NUMBER.search(line)) \
                        and int(m.group(1)) in XID_APPLICATION:
                    rule = FACT_RULES["xid_application"]
                self.add(rule, source, line, rank, time)
