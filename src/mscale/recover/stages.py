"""The stages `decide` strings together, behind one name each.

Why a module of its own: each stage is written separately (diagnose, checkpoints, exclude,
replan, rollback, the checkpoint pins), and `decide` calls them only through these names, so a
test replaces one stage (``monkeypatch.setattr(stages, "diagnose", fake)``) and the order and
arguments of the calls stay in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from mscale.config.plan import Plan
from mscale.config.records import DataSkip
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, Replan
from mscale.runs.rundir import RunDir


def diagnose(run_dir: str) -> Diagnosis:
    from mscale.recover.diagnose import diagnose as run

    return run(run_dir)


def choose_checkpoint(run: RunDir, diagnosis: Diagnosis, verify: str = "quick") -> CheckpointChoice:
    from mscale.recover.checkpoints import choose_checkpoint as choose

    return choose(run, diagnosis, verify=verify)


def decide_exclusions(run: RunDir, diagnosis: Diagnosis,
                      recheck: Callable[[list[str]], dict[str, str | None]] | None = None
                      ) -> Exclusions:
    from mscale.recover.exclude import decide_exclusions as decide

    return decide(run, diagnosis, recheck=recheck)


def replan(run: RunDir, plan: Plan, exclusions: Exclusions, *, allow_batch_change: bool = False,
           write: bool = True) -> Replan | None:
    from mscale.recover.replan import replan as make

    return make(run, plan, exclusions, allow_batch_change=allow_batch_change, write=write)


def data_skip_for(diagnosis: Diagnosis, choice: CheckpointChoice) -> DataSkip | None:
    from mscale.recover.rollback import data_skip_for as skip_for

    return skip_for(diagnosis, choice)


def record_data_skip(run: RunDir, skip: DataSkip) -> None:
    from mscale.recover.rollback import record_data_skip as record

    record(run, skip)


def pin_checkpoint(run: RunDir, path: str, reason: str) -> None:
    """Keep the checkpoint ``path`` out of retention (a ``KEEP`` file in it, `mscale.ckpt.pins`):
    the relaunch's own saves must not push the checkpoint it resumes from out of the window."""
    from mscale.ckpt import pins

    pins.pin(path, reason, who="recover")
