"""recover/exclude.py: quarantine in force, preflight for this plan, hardware suspects (with
their re-check); software failures never cost a node."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.config.records import Quarantine, QuarantineEntry
from mscale.recover.decision import Diagnosis
from mscale.recover.exclude import decide_exclusions
from mscale.runs.atomic import write_json_atomic
from mscale.runs.rundir import RunDir

PLAN = Path(__file__).resolve().parents[3] / "plans" / "cpu-tiny.yaml"  # tp2 pp2 dp2, node[1-4]
NOW = 1_000_000.0


@pytest.fixture
def run(tmp_path) -> RunDir:
    r = RunDir(str(tmp_path / "run"))
    r.create()
    shutil.copy(PLAN, r.plan)
    return r


def diag(cls="gpu", nodes=("node3",), symptom="crash"):
    return Diagnosis(cls=cls, symptom=symptom, summary="rank 4 died", suspect_nodes=list(nodes))


def quarantine(run, *entries):
    q = Quarantine(entries=[QuarantineEntry(node=n, reason=why, since=0.0, expires=exp)
                            for n, why, exp in entries])
    write_json_atomic(run.quarantine, q.model_dump(mode="json"))


def preflight(run, layout=None, world=8, bad=("node2",), also=()):
    results = [CheckResult(check="gemm", entity_kind="rank", entity="rank 2", node=n,
                           status="CRITICAL", message="GEMM at 40% of its peers") for n in bad]
    results.append(CheckResult(check="gemm", entity_kind="rank", entity="rank 0", node="node1",
                               status="OK"))
    rep = PreflightReport(world=world, layout=layout or {"tp": 2, "pp": 2, "dp": 2},
                          results=results, bad_nodes=sorted({*bad, *also}))
    write_json_atomic(run.preflight, rep.model_dump(mode="json"))


def test_nothing_to_exclude(run):
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == [] and ex.reasons == {}


def test_quarantine_entries_in_force(run):
    quarantine(run, ("node1", "slow GPU", None), ("node2", "hot", NOW - 1),
               ("node4", "slow link", NOW + 3600))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["node1", "node4"]
    assert ex.reasons["node1"] == "quarantine.json (until cleared): slow GPU"
    assert ex.reasons["node4"].startswith("quarantine.json (until 1970-01-12")


def test_preflight_for_this_plan_only(run):
    preflight(run, also=["node4"])  # node4: a quarantine entry preflight merged, since expired
    quarantine(run, ("node4", "old", NOW - 10))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["node2"]
    assert ex.reasons["node2"] == "preflight.json: gemm on rank 2: GEMM at 40% of its peers"
    preflight(run, layout={"tp": 2, "pp": 1, "dp": 4})  # another layout's groups
    assert decide_exclusions(run, diag(cls="software"), now=NOW).nodes == []


def test_a_quarantine_preflight_repeated_does_not_outlive_its_entry(run):
    """preflight makes a quarantined node of the job a CRITICAL `quarantine` result; once the
    entry expired (or was cleared), the node must not come back through preflight.json."""
    rep = PreflightReport(world=8, layout={"tp": 2, "pp": 2, "dp": 2}, bad_nodes=["node3"],
                          results=[CheckResult(check="quarantine", entity_kind="node",
                                               entity="node3", node="node3", status="CRITICAL",
                                               message="node3 is quarantined until ...")])
    write_json_atomic(run.preflight, rep.model_dump(mode="json"))
    quarantine(run, ("node3", "slow link", NOW - 10))  # expired
    assert decide_exclusions(run, diag(cls="software"), now=NOW).nodes == []


def test_a_transient_network_loss_excludes_only_on_a_failed_recheck(run):
    """A peer's lost connection is what every rank sees when another is SIGKILLed; under
    torchrun nothing else says so, and the node (on one node, the whole run) was excluded."""
    lost = Diagnosis(cls="network", symptom="crash", summary="a peer's connection was lost",
                     suspect_nodes=["node3"], transient=True, rule="peer_gone")
    assert decide_exclusions(run, lost, now=NOW).nodes == []  # nothing could re-check it
    assert decide_exclusions(run, lost, recheck=lambda n: {}, now=NOW).nodes == []
    failed = decide_exclusions(run, lost, recheck=lambda n: {"node3": "p2p at 10%"}, now=NOW)
    assert failed.nodes == ["node3"] and failed.reasons["node3"] == "re-check failed: p2p at 10%"
    nic = Diagnosis(cls="network", symptom="crash", summary="a NCCL/InfiniBand error",
                    suspect_nodes=["node3"], transient=True, rule="nccl_error")
    assert decide_exclusions(run, nic, now=NOW).nodes == ["node3"]  # a NIC error stays firm


def test_hardware_suspects_are_excluded(run):
    for cls in ("gpu", "network"):
        ex = decide_exclusions(run, diag(cls=cls), now=NOW)
        assert ex.nodes == ["node3"]
        assert ex.reasons["node3"] == f"diagnosis: {cls} failure (crash): rank 4 died"


@pytest.mark.parametrize("cls", ["software", "numerics", "user_code", "preemption", "storage"])
def test_other_classes_never_exclude(run, cls):
    asked = []
    ex = decide_exclusions(run, diag(cls=cls), recheck=lambda n: asked.append(n) or {},
                           now=NOW)
    assert ex.nodes == [] and asked == []


def test_recheck_keeps_a_healthy_suspect(run):
    ex = decide_exclusions(run, diag(nodes=["node2", "node3", "node4"]),
                           recheck=lambda nodes: {"node2": None, "node3": "gpu_health: Xid 79"},
                           now=NOW)
    assert ex.nodes == ["node3", "node4"]
    assert ex.reasons["node3"] == "re-check failed: gpu_health: Xid 79"
    assert ex.reasons["node4"].endswith("; not re-checked")


def test_unknown_class_needs_a_failed_recheck(run):
    assert decide_exclusions(run, diag(cls="unknown"), now=NOW).nodes == []
    ex = decide_exclusions(run, diag(cls="unknown", nodes=["node1", "node3"]),
                           recheck=lambda nodes: {"node1": None, "node3": "p2p: 2% of peers"},
                           now=NOW)
    assert ex.nodes == ["node3"]


def test_sources_combine_first_reason_wins(run):
    quarantine(run, ("node3", "watch: slow device", None))
    preflight(run, bad=["node2", "node3"])
    ex = decide_exclusions(run, diag(nodes=["node3", "node1"]), now=NOW)
    assert ex.nodes == ["node1", "node2", "node3"]
    assert ex.reasons["node3"].startswith("quarantine.json")
    assert ex.reasons["node1"].startswith("diagnosis: gpu")


def test_a_suspect_already_quarantined_is_not_rechecked(run):
    # watch quarantined node3 for a slow link: a preflight on it would take minutes (its link
    # is the fault) and could not bring it back; node1 is still re-checked
    quarantine(run, ("node3", "watch: slow link", None))
    asked = []
    ex = decide_exclusions(run, diag(cls="network", nodes=["node3", "node1"]),
                           recheck=lambda nodes: asked.append(nodes) or {"node1": None}, now=NOW)
    assert asked == [["node1"]]
    assert ex.nodes == ["node3"] and ex.reasons["node3"].startswith("quarantine.json")
