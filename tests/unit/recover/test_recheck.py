"""recover/recheck.py: a suspect node re-checked by a preflight.json newer than the failure (a
stale, damaged or undated one said, not used), by `srun … mscale preflight` on the job's nodes
under SLURM (with a line before and after on stderr, and SLURM's own word on a node that is
down), and not at all under --local; through `plan_recovery`, what the report says of it."""

from __future__ import annotations

import json
import time

import pytest

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.recover import exclude, stages
from mscale.recover.decide import RecoverOptions, plan_recovery
from mscale.recover.recheck import Rechecker, failure_time, judge_report
from mscale.recover.relaunch import Launch
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan

from tests.unit.recover.decide_fakes import NODES, T_FAIL, fakes, run  # noqa: F401 - fixtures


def report(t, bad=("node3",)) -> PreflightReport:
    results = [CheckResult(check="gemm", entity_kind="rank", entity=f"rank {r}",
                           node=NODES[r // 2], value=1.0, status="OK") for r in range(8)]
    results[5] = CheckResult(check="gemm", entity_kind="rank", entity="rank 5", node="node3",
                             value=0.2, status="CRITICAL", message="0.2x the median")
    return PreflightReport(time=t, world=8, layout={"tp": 2, "pp": 2, "dp": 2},
                           results=results, bad_nodes=list(bad))


def checker(run, launch, srun=None) -> Rechecker:
    plan = load_checked_plan(str(run / "plan.yaml"))
    kw = {"srun": srun} if srun else {}
    return Rechecker(RunDir(str(run)), plan, str(run / "plan.yaml"), launch,
                     since=failure_time(RunDir(str(run))), **kw)


def test_the_failure_time_skips_a_bad_events_line(run):
    """Read as the diagnosis reads the files (their tails, a bad line skipped): a line that is
    not JSON stopped recover's re-check with exit 3."""
    with open(run / "events.jsonl", "a") as f:
        f.write("NOT JSON\n")
    assert failure_time(RunDir(str(run))) == T_FAIL


def test_a_preflight_report_newer_than_the_failure_answers(run):
    assert failure_time(RunDir(str(run))) == T_FAIL
    (run / "preflight.json").write_text(report(T_FAIL + 5).model_dump_json())
    got = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))(["node3", "node2"])
    assert got["node2"] is None and "gemm: 0.2x the median" in got["node3"]
    (run / "preflight.json").write_text(report(T_FAIL - 5).model_dump_json())  # before: ignored
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {} and "not re-checked" in c.notes[0]


def test_a_damaged_preflight_report_is_said_not_passed_over(run):
    (run / "preflight.json").write_text('{"time": "yesterday"}')
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {}
    assert "is not a preflight report, not used" in c.notes[0], c.notes


def test_a_preflight_report_without_a_time_does_not_answer(run):
    """Read as it is, the model would give it the time of reading: newer than any failure."""
    doc = json.loads(report(T_FAIL + 5).model_dump_json())
    del doc["time"]
    (run / "preflight.json").write_text(json.dumps(doc))
    c = checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))
    assert c(["node3"]) == {} and "not re-checked" in c.notes[0]


def test_a_report_says_nothing_of_a_node_it_never_measured():
    """bad_nodes also lists quarantine.json's nodes outside the job: no verdict of preflight's."""
    assert judge_report(report(T_FAIL + 5, bad=("node3", "node9")), ["node3", "node9"]) == {
        "node3": "preflight re-check failed (gemm: 0.2x the median)"}


def test_a_stale_preflight_is_said_in_the_report_and_the_json(run, fakes, monkeypatch):
    """An operator must see why a node preflight.json names bad is not kept out."""
    from mscale.recover.report import render

    monkeypatch.setattr(stages, "decide_exclusions", exclude.decide_exclusions)
    fakes.diagnosis.cls, fakes.diagnosis.suspect_nodes = "software", []
    (run / "preflight.json").write_text(report(T_FAIL - 2 * 86_400).model_dump_json())
    plan = plan_recovery(str(run), RecoverOptions(recheck=False))
    note = ("preflight.json from 1969-12-30 00:16 UTC predates attempt 1 (started 1970-01-01 "
            "00:15 UTC): its bad nodes (node3) are not used")
    assert plan.exclusions.nodes == [] and note in plan.reasons
    assert plan.to_json()["exclusions"]["notes"] == [note]
    assert f"  - {note}\n" in render(plan, executed=False, decision=None)


def test_slurm_re_check_runs_preflight_on_the_jobs_nodes(run):
    seen = []

    def srun(argv, timeout):
        if argv[0] == "sinfo":
            return 0, "".join(f"{n} idle\n" for n in NODES), ""
        seen.append(argv)
        return 2, "rank 0 says hi\n" + report(time.time()).model_dump_json(), ""

    launch = Launch(argv=["/venv/bin/mscale", "train"], nodes=NODES, launcher="slurm",
                    slurm={"job_id": "7", "job_name": "j", "nodelist": "node[1-4]", "nnodes": 4})
    got = checker(run, launch, srun)(["node3"])
    assert "preflight re-check failed" in got["node3"]
    argv = seen[0]
    assert argv[:7] == ["srun", "--job-name=j-recheck", "--nodelist=node[1-4]", "--nodes=4",
                        "--ntasks=8", "--ntasks-per-node=2", "--immediate=60"]
    assert argv[7:10] == ["/venv/bin/mscale", "preflight", str(run / "plan.yaml")]


def test_a_slurm_re_check_says_a_line_before_and_after_on_stderr_only(run, capsys):
    """A re-check takes seconds to minutes: silence looks like a hang. stdout stays --json's."""
    def srun(argv, timeout):
        if argv[0] == "sinfo":
            return 0, "".join(f"{n} idle\n" for n in NODES), ""
        return 0, report(time.time()).model_dump_json(), ""

    launch = Launch(argv=["mscale"], nodes=NODES, launcher="slurm", slurm={"job_id": "7"})
    c = checker(run, launch, srun)
    c(["node3"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2, err
    assert lines[0].startswith("recover: re-checking node3 with preflight (up to 340 s)")
    assert lines[1].startswith("recover: re-check of node3 done in ") and "node3: preflight " \
        "re-check failed" in lines[1]


def test_a_local_run_is_not_re_checked_and_says_nothing(run, capsys):
    checker(run, Launch(argv=["mscale"], local=8, nodes=NODES))(["node3"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("state, excluded", [("drained", True), ("idle*", True), ("idle", False)])
def test_a_slurm_re_check_blames_a_node_only_on_a_report_or_slurms_word(run, state, excluded):
    calls = []

    def srun(argv, timeout):
        calls.append(argv[0])
        if argv[0] == "sinfo":
            return 0, f"node3 {state}\n", ""
        return 1, "", "srun: error: node1: task 1: Exited with exit code 3\n"

    launch = Launch(argv=["mscale"], nodes=NODES, launcher="slurm", slurm={"job_id": "7"})
    c = checker(run, launch, srun)
    got = c(["node3"])
    if excluded:  # known before any srun: no minute spent waiting for a node that is down
        assert got == {"node3": f"preflight could not run on it: SLURM reports it {state}"}
        assert calls == ["sinfo"]
    else:
        assert got == {} and "the preflight job failed (srun exit 1: srun: error: node1" \
            in c.notes[0]


def test_a_suspect_re_checked_healthy_is_said_to_be_kept(run, fakes):
    (run / "preflight.json").write_text(report(T_FAIL + 5, bad=()).model_dump_json())
    fakes.diagnosis.suspect_nodes = ["node2"]
    plan = plan_recovery(str(run))
    assert fakes.rechecked == {"node2": None}
    assert "node2 re-checked healthy by preflight: kept" in plan.reasons
