"""What a run says and records as it starts: the start line and ``start`` event, the data it
reads, what this attempt does differently (a changed plan, skipped data, test hooks off), and
what a resume found. Every line comes from rank 0 (`say`); every record goes through the run's
journal (`event`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from mscale.config.records import Event
from mscale.config.training import DataConfig, TrainingConfig
from mscale.runs.history import PlanChange
from mscale.train.console import moved_aside_line, resume_text, start_line
from mscale.train.data import DataIdentity, held_out_repeats, never_evaluated
from mscale.train.off_gpu import off_gpu_line
from mscale.train.resumed import is_own, model_note, resume_notes
from mscale.train.session import RunSession, Start, launch_record

if TYPE_CHECKING:  # the engine and checkpointer are built by the loop; only their types here
    from mscale.ckpt.checkpointer import Checkpointer
    from mscale.train.engine import Engine


def event(s: RunSession, **fields) -> None:
    s.journal.append(s.run.events, Event(source="train", **fields))


def say(engine: Engine, line: str) -> None:
    """A console line from rank 0 (the operator's view; other ranks keep to their logs). With
    ``--json`` stdout carries only the closing document, so the lines go to stderr."""
    if engine.env.rank == 0:
        print(line, flush=True, file=sys.stderr if engine.options.json_summary else sys.stdout)


def announce(engine: Engine, s: RunSession, start: Start) -> None:
    """The start line, the start event, and what this attempt does differently. The start event
    goes first: whatever groups events by attempt (recover's diagnosis, watch) begins an
    attempt at its start, so a note of this attempt written before it was counted with the
    previous one."""
    plan, change = engine.plan, start.change
    later: list[dict] = []  # this attempt's events, written after its start event
    say(engine, start_line(plan, engine.env.world_size, engine.env.launcher, s.run.root,
                            s.run_id, s.attempt, str(engine.device)))
    off_gpu = off_gpu_line(plan, engine.device.type)
    if off_gpu:
        say(engine, off_gpu)
        later.append(dict(kind="info", message=off_gpu, evidence={
            "planned_gpu": plan.cluster.gpu.name, "device": str(engine.device)}))
    say(engine, describe_data(plan.training.data))
    unread = never_evaluated(plan.training)
    if unread:
        say(engine, unread)
    if engine.eval_loader is not None:
        repeats = held_out_repeats(engine.loader.source,
                                   plan.training.eval.batches * plan.training.global_batch)
        if repeats:
            say(engine, repeats)
    if change is not None and change.kind == "changed":
        say(engine, plan_change_line(change, s.run.plans))
        if change.history is not None:  # written at the claim; else once a step will train
            later.append(plan_change_event(change, change.history))
        held_out = None if change.untrained else batch_change_note(change.fields, plan.training)
        if held_out:
            say(engine, held_out)
            later.append(dict(kind="info", severity="warning", message=held_out))
    event(s, kind="start", message=f"training {plan.name} on {engine.env.world_size} "
           f"processes ({engine.env.launcher})",
           evidence={**engine.timings, "run_id": s.run_id, "attempt": s.attempt,
                     "layout": plan.layout.model_dump(mode="json"), "device": str(engine.device),
                     "launcher": engine.env.launcher,
                     "launch": launch_record(engine.options.launch, plan,
                                             launcher=engine.env.launcher)})
    for fields in later:
        event(s, **fields)
    if engine.compiled:  # else the first step is a silent minute on a GPU
        say(engine, "the blocks are compiled (training.compile): the first step builds their "
             "kernels and takes longer than the rest; `compile: false` in the training file "
             "runs them eager")
    if s.attempt > 1 and engine.options.faults.armed:  # the engine installed none (faults.py)
        say(engine, f"test hooks (--inject-*) are off: this is attempt {s.attempt} of the run "
             "directory and they fire in attempt 1 only")
    skips = start.skips
    if skips.entries:
        text = "; ".join(f"after step {e.after_step}, the next {e.skip_steps} step(s)' samples"
                         + (f" ({e.reason})" if e.reason else "") for e in skips.entries)
        say(engine, f"skipping data: {text}; from {s.run.data_skip}")
        event(s, kind="info", message=f"data skipped: {text}",
               evidence={"data_skip": skips.model_dump(mode="json"), "file": s.run.data_skip})


def announce_resume(engine: Engine, s: RunSession, ckpt: Checkpointer, first: int) -> None:
    """What a resume (or its absence) says: the checkpoint and step, and every difference from
    what that checkpoint trained (data, schedule, model) as a line and a warning event. A
    changed source of the run directory's own checkpoint stops the run (train/resumed.py)."""
    plan = engine.plan
    own = ckpt.resumed_from is None or is_own(ckpt.resumed_from, s.run.ckpt)
    resumed = resume_text(ckpt.resumed_from, first, plan.training.steps, own)
    if resumed is None and s.attempt > 1 and engine.options.ckpt.resume == "auto":
        say(engine, f"no checkpoint in {s.run.ckpt} to resume from: attempt {s.attempt} "
            "trains from step 0 (what earlier attempts trained without a checkpoint is lost)")
    if not resumed:
        return
    for note in (c for c in ckpt.resume_cleaned if c.startswith("note: ")):
        say(engine, note)
    say(engine, resumed)
    moved = moved_aside_line(ckpt.resume_cleaned, s.run.ckpt)
    if moved:
        say(engine, moved)
    notes = resume_notes(ckpt.resumed_state, plan.training,
                         DataIdentity(ckpt.fingerprint, ckpt.data_sources),
                         is_own(ckpt.resumed_from, s.run.ckpt), ckpt.resumed_from,
                         data_change=engine.options.allow_data_change)
    model = model_note(ckpt.resumed_model, plan.model, ckpt.resumed_from)
    for note in notes + ([model] if model else []):
        say(engine, note)
        event(s, kind="info", severity="warning", step=first, message=note)


def plan_change_line(change: PlanChange, plans: str) -> str:
    """The console's line for a changed plan (`PlanChange` kind ``changed``)."""
    layout = (f"layout unchanged ({change.new_layout})" if change.old_layout ==
              change.new_layout else f"layout {change.old_layout} -> {change.new_layout}")
    untrained = "; no step trained with the run's plan, so this one replaces it" \
        if change.untrained else ""
    return (f"the plan changed since the last attempt ({', '.join(change.fields[:6])}"
            f"{' ...' if len(change.fields) > 6 else ''}){untrained}; {layout}; previous plans "
            f"kept in {plans}")


def plan_change_event(change: PlanChange, history: str) -> dict:
    """The ``info`` event of a changed plan, written once the plan is the run's: ``history`` is
    the ``RUN/plans/plan-NNNN.yaml`` that keeps it (at the claim for another layout, cluster or
    placement; when a step will train for any other change, `record_changed_plan`). A start
    that trains nothing leaves the run's plan, and records no change."""
    return dict(kind="info", message="plan changed on restart",
                evidence={"fields": list(change.fields), "old_layout": change.old_layout,
                          "new_layout": change.new_layout, "history": history,
                          "untrained": change.untrained})


def batch_change_note(changed: tuple[str, ...], training: TrainingConfig) -> str | None:
    """A line when a restart's new global batch (``--allow-batch-change``) changes the held-out
    set: an evaluation reads the first ``eval.batches`` global batches of the split, so the
    same count of larger batches is other samples. A curve that jumps there is not the model."""
    if "training.global_batch" not in changed or not training.eval.interval:
        return None
    return (f"the global batch changed: each evaluation now reads {training.eval.batches} "
            f"global batch(es) of {training.global_batch} held-out samples, another set, so "
            "held-out losses before this restart and after it are not comparable (docs/data.md)")


def describe_data(cfg: DataConfig) -> str:
    """One line for the start of a run: what it trains on, e.g. ``data: blend of 2 sources:
    src_a 25%, src_b 75%; held-out 5% of each``."""
    if cfg.kind != "tokens":
        return "data: synthetic (a seeded stream; held-out: the same chain, other draws)"
    train = cfg.train_sources
    total = sum(s.weight for s in train)
    if len(train) == 1:
        text = f"data: {train[0].path}"
    else:
        text = (f"data: blend of {len(train)} sources: "
                + ", ".join(f"{s.path} {_percent(s.weight / total)}" for s in train))
    if cfg.eval_sources:
        text += "; held-out: " + ", ".join(s.path for s in cfg.eval_sources)
    elif cfg.eval_fraction:
        text += f"; held-out {_percent(cfg.eval_fraction)}" + (" of each" if len(train) > 1 else "")
    else:
        text += "; no held-out split"
    return text


def _percent(x: float) -> str:
    """A share, rounded but never to "0%" when above 0 nor to "100%" when below 1: a weight of 1
    beside 1,000,000 is a real share, which "0%" said was not read at all."""
    p = 100 * x
    if 0 < p < 0.05:
        return "<0.1%"
    if 99.95 <= p < 100:
        return ">99.9%"
    whole = abs(p - round(p)) < 0.05 or (p >= 10 and round(p) < 100)
    return f"{p:.0f}%" if whole else f"{p:.1f}%"
