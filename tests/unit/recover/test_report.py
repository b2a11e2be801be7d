"""recover/report.py: the readable report, from a RecoveryPlan alone (no CLI, no run directory).
The CLI's own tests (tests/unit/cli/test_recover_cli.py) check it through `mscale recover`."""

from mscale.recover.decision import (CheckpointChoice, Diagnosis, Evidence, Exclusions,
                                     RecoveryPlan)
from mscale.recover.relaunch import NO_LAUNCH_NOTE
from mscale.recover.report import EVIDENCE_LINES, LINE_CHARS, exit_code, render


def _plan(evidence, verdict="relaunchable", command=("mscale", "train", "p.yaml")):
    d = Diagnosis(cls="network", symptom="crash", summary="a link dropped", evidence=evidence,
                  suspect_ranks=[3], failed_step=7)
    return RecoveryPlan(run_dir="runs/r1", diagnosis=d,
                        checkpoint=CheckpointChoice(path="runs/r1/ckpt/step-000006", step=6,
                                                    reason="newest committed that verifies"),
                        exclusions=Exclusions(), replan=None, verdict=verdict,
                        command=list(command), launcher="local")


def test_the_report_keeps_its_sections_and_cuts_evidence():
    many = [Evidence(source=f"logs/rank{i}.log", text="x" * 400, rank=i,
                     also_ranks=list(range(20))) for i in range(EVIDENCE_LINES + 2)]
    text = render(_plan(many), executed=False, decision=None)
    lines = text.splitlines()
    assert lines[0] == "recover runs/r1: RELAUNCHABLE (exit 0)"
    assert "diagnosis: network / crash — a link dropped" in lines
    shown = [x for x in lines if x.startswith("  logs/rank")]
    assert len(shown) == EVIDENCE_LINES and all(len(x) <= LINE_CHARS for x in shown)
    assert all(x.endswith("…]") and "+20 more rank(s)" in x for x in shown)
    assert "  … 2 more evidence line(s) in --json" in lines
    assert "  suspect ranks 3; last step 7" in lines
    assert "checkpoint: runs/r1/ckpt/step-000006 (step 6) — newest committed that verifies" in lines
    assert lines[-2:] == ["", "dry run: nothing written; add --execute to act"]
    assert "relaunch (local):" in lines and "  mscale train p.yaml" in lines


def test_a_run_with_no_recorded_launch_is_said_relaunchable_by_hand_only():
    """No launch recorded: RELAUNCHABLE beside "recover cannot relaunch it" and "add --execute
    to act" (which then ran nothing and exited 3) did not agree."""
    plan = _plan([], command=())
    plan.reasons = ["relaunch as before, from step 6", NO_LAUNCH_NOTE]
    lines = render(plan, executed=False, decision=None).splitlines()
    assert lines[0] == ("recover runs/r1: RELAUNCHABLE (exit 0); by hand: recover has no "
                        "launch command to run")
    assert lines[-1] == ("dry run: nothing written; --execute would only record this decision "
                         "and exit 3 (nothing relaunched): start the job again yourself with "
                         "its own command (it resumes as said above), or run it under `mscale "
                         "recover supervise -- CMD`")
    assert not any("relaunch (" in x for x in lines)


def test_an_executed_plan_by_hand_says_the_exit_code_it_ends_with():
    """--execute by hand ends 3 (nothing relaunched) while its header said "(exit 0)": a reader
    of the log, or a script grepping it, took the run for relaunched."""
    plan = _plan([], command=())
    plan.reasons = ["relaunch as before, from step 6", NO_LAUNCH_NOTE]
    assert exit_code(plan, executed=True) == 3 and exit_code(plan, executed=False) == 0
    lines = render(plan, executed=True, decision="runs/r1/recover/decision-0001.json").splitlines()
    assert lines[0] == ("recover runs/r1: RELAUNCHABLE by hand (exit 3: nothing relaunched, "
                        "recover has no launch command to run)")
    assert lines[-1] == "decision written to runs/r1/recover/decision-0001.json"
    assert exit_code(_plan([]), executed=True) == 0  # a job run here: its own code, later


def test_an_executed_plan_names_its_decision_file():
    text = render(_plan([]), executed=True, decision="runs/r1/recover/decision-0001.json")
    assert text.endswith("decision written to runs/r1/recover/decision-0001.json; relaunching\n")


def test_the_relaunch_names_the_directory_its_relative_paths_are_taken_from():
    """A job started as `mscale train ../plans/p.yaml` from /work/jobs: the command shown keeps
    the relative plan (it is the job's own), so the report says where to run it; copied into
    another directory it would fail with 'file not found'."""
    plan = _plan([], command=("mscale", "train", "../plans/p.yaml"))
    plan.cwd = "/work/jobs"
    lines = render(plan, executed=False, decision=None).splitlines()
    assert "relaunch (local, from /work/jobs):" in lines and "  mscale train ../plans/p.yaml" \
        in lines
