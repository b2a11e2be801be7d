"""A slow link watch could not place (its finding lists suspects and names no node): recover
excludes none of them and says why, with the step that finds the node (detect/links.py)."""

from __future__ import annotations

import json

from mscale.recover.decide import plan_recovery
from mscale.recover.diagnose.classify import diagnose

from tests.unit.recover.decide_fakes import (T_FAIL, fakes, run,  # noqa: F401 - fixtures
                                             write_events)

SUSPECTS = ["node1", "node2"]


def unplaced() -> dict:
    """The event watch records for a slow link on one of node1, node2."""
    return {"kind": "straggler", "source": "watch", "severity": "critical",
            "time": T_FAIL - 10, "step": 13, "ranks": [], "nodes": [],
            "message": "slow link on one of node1, node2 (…); no node is named",
            "evidence": {"cause": "slow_link", "suspects": SUSPECTS, "first_step": 6,
                         "action": "recorded"}}


def test_the_diagnosis_keeps_the_suspects_apart_from_the_nodes_to_exclude(run):
    events = (run / "events.jsonl").read_text().splitlines()
    start, stop = json.loads(events[0]), json.loads(events[1])
    stop.update(ranks=[], nodes=[], evidence={"exit_code": 1, "reason": "halt"})
    write_events(run, [start, unplaced(), stop])
    d = diagnose(str(run))
    assert d.rule == "slow_link" and d.suspect_nodes == [] and d.link_suspects == SUSPECTS


def test_the_verdict_excludes_no_suspect_and_says_how_to_find_the_node(run, fakes):
    fakes.diagnosis.rule, fakes.diagnosis.cls = "slow_link", "network"
    fakes.diagnosis.suspect_ranks, fakes.diagnosis.suspect_nodes = [], []
    fakes.diagnosis.link_suspects = SUSPECTS
    plan = plan_recovery(str(run))
    assert plan.verdict == "relaunchable" and plan.exclusions.nodes == []
    [line] = [r for r in plan.reasons if "slow link" in r]
    assert "one of node1, node2" in line and "no node is excluded" in line
    assert "`mscale preflight`" in line


def cleared(event: dict, step: int) -> dict:
    """The record watch writes when ``event``'s finding closed (watch/actions.py `clear`)."""
    return {**event, "kind": "info", "severity": "info", "time": event["time"] + 1,
            "message": f"cleared after step {step}: {event['message']}",
            "evidence": {**event["evidence"], "cleared": True, "last_step": step,
                         "finding": "straggler", "action": "none: the finding cleared"}}


def test_a_slow_link_that_cleared_is_not_named_and_each_findings_last_word_counts(run):
    """A link that recovered before the stop is not named; of two findings the one still open
    is, even when the other was recorded later."""
    events = (run / "events.jsonl").read_text().splitlines()
    start, stop = json.loads(events[0]), json.loads(events[1])
    stop.update(ranks=[], nodes=[], evidence={"exit_code": 1, "reason": "halt"})
    old = unplaced()
    old["evidence"]["finding_key"] = ["straggler", "slow_link", [], ["node1", "node2"]]
    old["time"] = T_FAIL - 30
    other = unplaced()
    other["evidence"].update(suspects=["node3", "node4"],
                             finding_key=["straggler", "slow_link", [], ["node3", "node4"]])
    write_events(run, [start, other, old, cleared(old, 20), stop])
    d = diagnose(str(run))
    assert d.rule == "slow_link" and d.link_suspects == ["node3", "node4"]
    write_events(run, [start, old, cleared(old, 20), stop])
    assert diagnose(str(run)).link_suspects == []
