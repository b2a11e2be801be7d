"""docs/recover.md prints the diagnosis rule tables: every rule's row must match the code."""

from __future__ import annotations

import re

from mscale.recover.diagnose.rules import FACT_RULES, TEXT_RULES
from tests.conftest import REPO

DOC = (REPO / "docs" / "recover.md").read_text()


def row(key: str) -> list[str]:
    found = [line for line in DOC.splitlines() if line.startswith(f"| `{key}` |")]
    assert len(found) == 1, f"docs/recover.md has {len(found)} rows for rule {key}"
    return [c.strip() for c in re.split(r"(?<!\\)\|", found[0])[1:-1]]


def test_every_rule_has_its_row_with_the_same_class_symptom_transience_and_weight():
    for rule in [*TEXT_RULES, *FACT_RULES.values()]:
        cells = row(rule.key)
        assert cells[1:5] == [rule.cls, rule.symptom, "yes" if rule.transient else "no",
                              str(rule.weight)], rule.key


def test_text_rule_rows_show_the_real_pattern():
    for rule in TEXT_RULES:
        shown = row(rule.key)[5].replace("\\|", "|")
        assert shown.startswith(f"`{rule.pattern.pattern}`"), rule.key
