"""A run that failed before its first checkpoint: started over from step 0 when that loses fewer
steps than one checkpoint interval, a person's call when it would throw away real work or only
fail again (recover/start_over.py; docs/recover.md "Verdict and relaunch")."""

from __future__ import annotations

import pytest

from mscale.recover.checkpoints import UNCOMMITTED
from mscale.recover.decide import plan_recovery
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions

from tests.unit.recover.decide_fakes import (NODES, T_FAIL, fakes, run,  # noqa: F401
                                             write_events)


def early_crash(run, fakes, *extra_events, interval: str | None = "5") -> None:
    """The fixture's run with ``--ckpt-interval`` in its command, a network crash at step 2
    (transient, nobody suspect) and no checkpoint, then ``extra_events``."""
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run),
            "--local", "8"] + (["--ckpt-interval", interval] if interval else [])
    start = {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
        "launcher": "local", "attempt": 1, "launch": {
            "argv": argv, "cwd": str(run.parent), "plan": str(run / "plan.yaml"), "local": 8,
            "nodes": NODES, "slurm": None}}}
    write_events(run, [*extra_events, start,
                       {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5]}])
    fakes.diagnosis = Diagnosis(cls="network", symptom="crash", summary="a peer was lost",
                                failed_step=2, attempt=1, transient=True)
    fakes.choice = CheckpointChoice(path=None, step=None, reason="no checkpoint")
    fakes.exclusions = Exclusions()


def test_a_crash_before_the_first_checkpoint_starts_over_from_step_0(run, fakes):
    early_crash(run, fakes)
    plan = plan_recovery(str(run))
    assert (plan.verdict, plan.exit_code) == ("relaunchable", 0), plan.reasons
    assert plan.command[-2:] == ["--ckpt-interval", "5"] and "--resume" not in plan.command
    assert plan.reasons == [
        "the run failed before its first checkpoint (interval 5 steps): starting over from "
        "step 0 retrains steps 1-2, fewer than one interval",
        "relaunch as before, from step 0 (no checkpoint yet)"]


def test_the_plans_own_interval_counts_when_the_command_sets_none(run, fakes):
    early_crash(run, fakes, interval=None)
    assert plan_recovery(str(run)).verdict == "unrecoverable"  # cpu-tiny sets no interval
    text = (run / "plan.yaml").read_text()
    (run / "plan.yaml").write_text(text.replace("  steps: 40\n",
                                                "  steps: 40\n  checkpoint_interval: 4\n"))
    assert plan_recovery(str(run)).verdict == "relaunchable"


def recovered_from_0(step: int) -> dict:
    """An earlier recovery's event (apply_plan) that relaunched from step 0."""
    return {"kind": "recover", "source": "recover", "time": T_FAIL - 100, "step": None,
            "evidence": {"verdict": "relaunchable", "checkpoint": {"path": None, "step": None},
                         "diagnosis": {"failed_step": step}}}


@pytest.mark.parametrize("case,why", [
    ("past_interval", "it is past its checkpoint interval (5 steps)"),
    ("save_failed", "a save at step 5 failed or was cut short"),
    ("cut_short", "a save failed or was cut short"),
    ("damaged", "its checkpoints are all unusable: step-000005"),
    ("no_interval", "the run has no checkpoint interval"),
    ("repeats", "an earlier relaunch from step 0 failed again before its first checkpoint"),
])
def test_a_start_over_that_throws_work_away_or_repeats_stays_a_persons_call(run, fakes, case,
                                                                           why):
    extra = {"save_failed": [{"kind": "checkpoint_failed", "source": "train", "step": 5,
                              "time": T_FAIL - 200}],
             "repeats": [recovered_from_0(3)]}.get(case, [])
    early_crash(run, fakes, *extra, interval=None if case == "no_interval" else "5")
    if case == "past_interval":
        fakes.diagnosis.failed_step = 7
    if case in ("cut_short", "damaged"):
        fakes.choice.rejected = [{"name": "step-000005", "why": UNCOMMITTED if case ==
                                  "cut_short" else "failed quick verify: crc"}]
    plan = plan_recovery(str(run))
    assert (plan.verdict, plan.exit_code, plan.command) == ("unrecoverable", 2, [])
    [said] = [r for r in plan.reasons if "human's call" in r]
    assert why in said, said


def test_an_operators_stop_that_started_over_is_no_repeat(run, fakes):
    """A degraded start over (an operator's Ctrl-C chose to lose its steps) was no crash."""
    earlier = recovered_from_0(3)
    earlier["evidence"]["verdict"] = "degraded"
    early_crash(run, fakes, earlier)
    assert plan_recovery(str(run)).verdict == "relaunchable"
