"""Whether a failed run with no checkpoint to resume from may start over from step 0 unasked.

A run that failed before its first interval checkpoint loses, started over, fewer steps than one
checkpoint interval: no more than any crash loses between two checkpoints. Calling that
unrecoverable stops `recover supervise` (exit 2) and pages a person whose only choice is the
same relaunch. It stays a person's call where starting over throws away real work or would
only fail again: a save that failed or was cut short, checkpoints that are all damaged, steps
at or past the interval (its save never happened), no interval to measure the loss against,
or an earlier relaunch from step 0 that failed again before its first checkpoint.
`decide._verdict` asks `judge` only when the choice has no checkpoint and the run made
progress; bad input and user code are refused before it (docs/recover.md "Verdict").
"""

from __future__ import annotations

from dataclasses import dataclass

from mscale.ckpt.options import CkptOptions
from mscale.config.plan import Plan
from mscale.recover.checkpoints import UNCOMMITTED
from mscale.recover.command import option_value
from mscale.recover.decision import CheckpointChoice
from mscale.recover.phases import read_events
from mscale.runs.rundir import RunDir


@dataclass
class StartOver:
    """The answer: ``allowed``, and ``why`` in one clause (the reason's tail either way)."""

    allowed: bool
    why: str


def for_run(run: RunDir, plan: Plan, choice: CheckpointChoice, progress: int,
            *commands: list[str] | None) -> StartOver:
    """`judge` for ``run``, its interval read from ``commands`` and ``plan``."""
    return judge(choice, progress, interval(plan, *commands), read_events(run))


def interval(plan: Plan, *commands: list[str] | None) -> int | None:
    """The checkpoint interval the failed attempt ran with, as train picks it
    (`CkptOptions.interval_for`): ``--ckpt-interval`` of the first command that sets it, the
    plan's ``training.checkpoint_interval``, the planner's advice; None when none is set."""
    given = next((int(v) for v in (option_value(c or [], "--ckpt-interval") for c in commands)
                  if v and v.isdigit() and int(v) > 0), None)
    return CkptOptions(interval=given).interval_for(plan)


def judge(choice: CheckpointChoice, progress: int, every: int | None,
          events: list[dict]) -> StartOver:
    """May a run that reached step ``progress`` with no usable checkpoint (``choice``) start
    over from step 0? ``every``: its checkpoint interval (`interval`); ``events``: the run's
    events (`phases.read_events`), for failed saves and earlier starts over."""
    if any(r.get("why") != UNCOMMITTED for r in choice.rejected):
        names = ", ".join(str(r.get("name")) for r in choice.rejected)
        return StartOver(False, f"its checkpoints are all unusable: {names}")
    failed = [e.get("step") for e in events if e.get("kind") == "checkpoint_failed"]
    if failed or choice.rejected:
        at = f" at step {failed[-1]}" if failed and failed[-1] is not None else ""
        return StartOver(False, f"a save{at} failed or was cut short")
    if every is None:
        return StartOver(False, "the run has no checkpoint interval to bound what a start over "
                                "loses")
    if progress >= every:
        return StartOver(False, f"it is past its checkpoint interval ({every} steps), so its "
                                "first save never committed")
    if any(_started_over(e) for e in events):
        return StartOver(False, "an earlier relaunch from step 0 failed again before its first "
                                "checkpoint: a crash that repeats")
    return StartOver(True, f"the run failed before its first checkpoint (interval {every} "
                           f"steps): starting over from step 0 retrains steps 1-{progress}, "
                           "fewer than one interval")


def how(choice: CheckpointChoice) -> str:
    """The way a person starts the run over: train refuses ``--resume none`` on a run that
    holds committed checkpoints, damaged ones included (ckpt/resume.py)."""
    if any(r.get("why") != UNCOMMITTED for r in choice.rejected):
        return ("train it in a new --run-dir: --resume none is refused while this one holds "
                "committed checkpoints")
    return "the job's own command with --resume none"


def _started_over(event: dict) -> bool:
    """An earlier recovery's event (`decide.apply_plan`) that relaunched from step 0 after a
    failure: no checkpoint, verdict relaunchable (an operator's stop without one is degraded)."""
    ev = event.get("evidence") if event.get("kind") == "recover" else None
    if not isinstance(ev, dict) or ev.get("verdict") != "relaunchable":
        return False
    ckpt = ev.get("checkpoint")
    return isinstance(ckpt, dict) and ckpt.get("path") is None
