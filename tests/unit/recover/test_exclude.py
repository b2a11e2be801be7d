"""recover/exclude.py: quarantine in force, preflight for this plan and of the failed attempt,
hardware suspects (with their re-check); software failures never cost a node."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.config.records import Quarantine, QuarantineEntry
from mscale.recover.decision import Diagnosis, Exclusions
from mscale.recover.exclude import decide_exclusions, released, with_carried
from mscale.runs.atomic import write_json_atomic
from mscale.runs.rundir import RunDir

PLAN = Path(__file__).resolve().parents[3] / "plans" / "cpu-tiny.yaml"  # tp2 pp2 dp2, node[1-4]
NOW = 1_000_000.0
T_START = 1_796_000_000.0  # the failed attempt's start: 2026-11-30 00:53 UTC
DAY = 86_400.0


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


def preflight(run, layout=None, world=8, bad=("node2",), also=(), t=None):
    results = [CheckResult(check="gemm", entity_kind="rank", entity="rank 2", node=n,
                           status="CRITICAL", message="GEMM at 40% of its peers") for n in bad]
    results.append(CheckResult(check="gemm", entity_kind="rank", entity="rank 0", node="node1",
                               status="OK"))
    rep = PreflightReport(world=world, layout=layout or {"tp": 2, "pp": 2, "dp": 2},
                          results=results, bad_nodes=sorted({*bad, *also}),
                          **({} if t is None else {"time": t}))
    write_json_atomic(run.preflight, rep.model_dump(mode="json"))


def attempt(run, launcher="local", slurm=None):
    """events.jsonl of a run whose attempt 2 started at T_START on node[1-4] (the plan's names)."""
    launch = {"argv": ["mscale", "train"], "local": 8 if launcher == "local" else 0,
              "nodes": ["node1", "node2", "node3", "node4"], "slurm": slurm}
    start = {"schema_version": 1, "time": T_START, "source": "train", "kind": "start",
             "message": "training", "evidence": {"run_id": f"{launcher}-2", "attempt": 2,
                                                 "launcher": launcher, "launch": launch}}
    Path(run.events).write_text(json.dumps(start) + "\n")


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


def test_a_plan_name_in_quarantine_is_read_as_slurms_name(run):
    """watch quarantines by the plan's name; the attempt ran under SLURM's names: the entry
    keeps out (and its expiry releases) the node SLURM knows. With names in common between
    the two lists a name could mean either node: it is taken as written."""
    attempt(run, "slurm", slurm={"job_id": "7", "nodelist": "gpu[1-4]"})
    ran = ["gpu1", "gpu2", "gpu3", "gpu4"]
    quarantine(run, ("node3", "watch: slow GPU", None), ("node2", "watch: hot", NOW - 1))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW, ran=ran)
    assert ex.nodes == ["gpu3"]
    assert ex.reasons["gpu3"] == ("quarantine.json (until cleared): watch: slow GPU (entered as "
                                  "node3, the plan's name for gpu3)")
    assert released(run, NOW, {"node2": "gpu2"}) == ["gpu2"]
    ex = decide_exclusions(run, diag(cls="software"), now=NOW, ran=["node2", "node3", "node4",
                                                                   "node5"])
    assert ex.nodes == ["node3"] and "entered as" not in ex.reasons["node3"]


def test_nodes_whose_quarantine_expired_are_released(run):
    """Their exclusion by an earlier recovery lives on in the job's command (command.py keeps
    what the command excluded): a node back in the pool must be named to be let back."""
    assert released(run, NOW) == []
    quarantine(run, ("node1", "slow GPU", None), ("node2", "hot", NOW - 1),
               ("node3", "old", NOW - 5), ("node3", "again", NOW + 60))
    assert released(run, NOW) == ["node2"]  # node3 still has an entry in force


def decision(run, number, reasons):
    """An earlier recovery's decision document, with the reasons it kept nodes out."""
    write_json_atomic(f"{run.recover}/decision-{number:04d}.json",
                      {"exclusions": {"nodes": sorted(reasons), "reasons": reasons}})


def test_a_node_cleared_from_quarantine_by_hand_is_released_like_an_expired_one(run):
    """An operator who deletes node3's entry (or the whole file, as QUARANTINE_FIX says) means
    it is back in the pool; the earlier recovery's --exclude of it must not outlive that. A node
    kept out for another reason (node2: its diagnosis), or never by recover, stays out."""
    decision(run, 1, {"node3": "quarantine.json (until cleared): slow GPU",
                      "node2": "diagnosis: gpu failure (crash): Xid 79"})
    quarantine(run, ("node3", "slow GPU", None))
    assert released(run, NOW) == []  # still held
    quarantine(run)  # the operator cleared it
    assert released(run, NOW) == ["node3"]
    Path(run.quarantine).unlink()
    assert released(run, NOW) == ["node3"]


def test_the_latest_recovery_to_keep_a_node_out_says_why(run):
    """node3 came back from quarantine, failed again, and was kept out on its diagnosis (no
    quarantine entry): it is not released. Decisions are ordered by number, not by name."""
    decision(run, 9999, {"node3": "quarantine.json (until cleared): slow GPU"})
    decision(run, 10000, {"node3": "diagnosis: gpu failure (crash): Xid 79"})
    assert released(run, NOW) == []


def test_a_node_let_back_is_not_released_again_until_quarantined_anew(run):
    """Recovery 1 let node3 back (its decision's exclusions.released, at its time): node3 in
    the job's exclusions after that was put there by an operator, and stays; its old expired
    entry and recovery 0's quarantine reason no longer release it. A quarantine entry newer
    than the release does, once it no longer holds."""
    decision(run, 1, {"node3": "quarantine.json (until cleared): slow GPU"})
    write_json_atomic(f"{run.recover}/decision-0002.json",
                      {"time": NOW - 100, "exclusions": {"nodes": [], "reasons": {},
                                                         "released": ["node3"]}})
    quarantine(run, ("node3", "slow GPU", NOW - 200))
    assert released(run, NOW) == []
    q = Quarantine(entries=[QuarantineEntry(node="node3", reason="hot", since=NOW - 50,
                                            expires=NOW - 1)])
    write_json_atomic(run.quarantine, q.model_dump(mode="json"))
    assert released(run, NOW) == ["node3"]


def test_the_jobs_own_exclusions_count_only_where_they_cost_the_relaunch_a_node():
    mine = Exclusions(nodes=["node3"], reasons={"node3": "diagnosis"})
    carried = {n: "the command's" for n in ("node2", "node3", "node4", "node5", "node9")}
    out = with_carried(mine, carried, released=["node2"],
                       ran=["node1", "node2", "node3", "node4", "node5"])
    # node2 released, node3 this recovery's, node9 not among the nodes the attempt ran on
    assert out.carried == {"node4": "the command's", "node5": "the command's"}
    assert out.kept_out == ["node3", "node4", "node5"] and out.nodes == ["node3"]
    assert with_carried(mine, {"node9": "x"}, [], ran=None).kept_out == ["node3", "node9"]


def test_preflight_for_this_plan_only(run):
    preflight(run, also=["node4"])  # node4: a quarantine entry preflight merged, since expired
    quarantine(run, ("node4", "old", NOW - 10))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["node2"]
    assert ex.reasons["node2"] == "preflight.json: gemm on rank 2: GEMM at 40% of its peers"
    preflight(run, layout={"tp": 2, "pp": 1, "dp": 4})  # another layout's groups
    assert decide_exclusions(run, diag(cls="software"), now=NOW).nodes == []


def test_a_preflight_older_than_the_attempt_is_not_used_and_said(run):
    """A node preflight found sick two days before the attempt may have been repaired since:
    kept out on that report, it would stay out for good. The note says why it is not."""
    attempt(run)
    preflight(run, t=T_START - 2 * DAY)
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == []
    assert ex.notes == ["preflight.json from 2026-11-28 00:53 UTC predates attempt 2 (started "
                        "2026-11-30 00:53 UTC): its bad nodes (node2) are not used"]


@pytest.mark.parametrize("dt", [-10 * 60.0, 3600.0])  # the job's own, just before; after it
def test_a_preflight_of_the_attempt_is_used(run, dt):
    attempt(run)
    preflight(run, t=T_START + dt)
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["node2"] and ex.notes == []


def test_a_preflight_without_a_time_is_of_unknown_age(run):
    """Read as it is, the model would give it the time of reading: any old file passes."""
    attempt(run)
    preflight(run, t=T_START)
    doc = json.loads(Path(run.preflight).read_text())
    del doc["time"]
    Path(run.preflight).write_text(json.dumps(doc))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == []
    assert ex.notes == ["preflight.json has no time (unknown age), so it cannot be dated against "
                        "attempt 2 (started 2026-11-30 00:53 UTC): its bad nodes (node2) are not "
                        "used"]


def test_a_preflight_judges_only_the_nodes_the_attempt_ran_on(run):
    """SLURM gave the attempt gpu[1-4]: gpu7, named bad by the same report, is another
    allocation's node; the report said nothing of it for this run."""
    attempt(run, launcher="slurm", slurm={"job_id": "8", "nodelist": "gpu[1-4]"})
    preflight(run, bad=("gpu3", "gpu7"), t=T_START - 60)
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["gpu3"]
    assert ex.notes == ["preflight.json's bad nodes gpu7 are not among attempt 2's nodes: "
                        "not used"]


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


def test_a_quarantine_json_that_is_not_json_is_refused_not_half_read(run):
    """A hand edit with a trailing comma: the diagnosis called the file "not valid JSON" while
    the exclusions read it as YAML and kept node3 out. Every reader now parses it as JSON, and
    recover stops with the file and the fix (exit 3) instead of acting on half of it."""
    from mscale.errors import EXIT_BAD_INPUT, MscaleError

    Path(run.quarantine).write_text('{"schema_version": 1, "entries": [{"node": "node3", '
                                    '"reason": "bad nic", "since": 0.0,}]}')
    with pytest.raises(MscaleError) as e:
        decide_exclusions(run, diag(cls="software"), now=NOW)
    assert e.value.file == run.quarantine and e.value.code == EXIT_BAD_INPUT
    assert "trailing comma" in e.value.fix


def test_a_quarantined_node_outside_the_run_says_so(run):
    """node9 is not one of the plan's node[1-4]: recover listed it like a node it took out,
    then relaunched as before. It stays excluded (a SLURM relaunch must not be given it) and
    its line says why nothing else changes."""
    quarantine(run, ("node9", "bad nic", None), ("node3", "slow GPU", None))
    ex = decide_exclusions(run, diag(cls="software"), now=NOW)
    assert ex.nodes == ["node3", "node9"]
    assert ex.reasons["node9"].endswith("(not one of the run's nodes: only a new allocation "
                                        "avoids it)")
    assert "not one of" not in ex.reasons["node3"]


def test_a_preflight_report_holding_nan_is_still_read(run):
    """preflight.json is a record: a NaN measurement is kept as measured, and its readers take
    it (quarantine.json's strict JSON reading is not theirs)."""
    attempt(run)
    rep = PreflightReport(world=8, layout={"tp": 2, "pp": 2, "dp": 2}, time=T_START - 60,
                          results=[CheckResult(check="gemm", entity_kind="rank", entity="rank 2",
                                               node="node2", status="CRITICAL",
                                               value=float("nan"), message="no figure")],
                          bad_nodes=["node2"])
    write_json_atomic(run.preflight, rep.model_dump(mode="json"))
    assert "NaN" in Path(run.preflight).read_text()
    ex = decide_exclusions(run, diag(cls="software"), now=T_START + 60)
    assert ex.nodes == ["node2"]
