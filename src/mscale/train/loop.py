"""The training loop: one optimizer step at a time, with timing, metrics, control and stops.

Exit codes of a training process (docs/train.md):
  0  finished every step
  1  stopped early at a step boundary on request (control/halt, SIGTERM, SIGUSR1)
  2  stopped before the optimizer step because the loss or gradients were NaN/Inf
  3  bad input, or crashed (the traceback is in RUN_DIR/logs/rank<N>.error.json)
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
import traceback
from dataclasses import dataclass

from mscale.ckpt.checkpointer import Checkpointer, CkptOptions
from mscale.config.base import dump_yaml
from mscale.config.plan import Plan
from mscale.config.records import Event
from mscale.errors import EXIT_BAD_INPUT, EXIT_CRITICAL, EXIT_OK, EXIT_WARNING, MscaleError
from mscale.runs.atomic import write_text_atomic
from mscale.runs.rundir import RunDir
from mscale.topology.env import LaunchEnv
from mscale.topology.placement import placement_record
from mscale.train.control import Control
from mscale.train.data import source_fingerprint
from mscale.train.engine import Engine, build_engine
from mscale.planner.flops import model_flops
from mscale.train.metrics import build_record, gather_rank_vectors
from mscale.train.options import TrainOptions
from mscale.train.progress import ProgressReporter
from mscale.train.schedule import learning_rate
from mscale.train.step import forward_backward
from mscale.train.timers import StepTimer


def train(plan: Plan, options: TrainOptions, env: LaunchEnv) -> int:
    """Run one training process to completion; returns its exit code (see module docstring)."""
    run = RunDir(options.run_dir)
    try:
        engine = build_engine(plan, env, options)
    except MscaleError:
        raise
    except Exception:
        _write_error(run, env.rank)
        raise
    try:
        return _run(engine, run)
    except MscaleError:  # e.g. a damaged checkpoint at resume: one message, no traceback
        raise
    except Exception:
        _write_error(run, env.rank)
        traceback.print_exc()
        return EXIT_BAD_INPUT


def _write_error(run: RunDir, rank: int) -> None:
    """A crashed rank leaves its traceback where recover can read it (cf. torchelastic @record)."""
    with contextlib.suppress(Exception):
        write_text_atomic(run.path("logs", f"rank{rank}.error.json"), json.dumps(
            {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()}))


def _event(engine: Engine, run: RunDir, **fields) -> None:
    if engine.env.rank == 0:
        run.append_record(run.events, Event(source="train", **fields))


def _start(engine: Engine, run: RunDir) -> None:
    plan = engine.plan
    if engine.env.rank == 0:
        run.create()
        resolved = plan.model_copy(update={"placement": plan.placement or placement_record(plan)})
        write_text_atomic(run.plan, dump_yaml(resolved))
    _event(engine, run, kind="start", message=f"training {plan.name} on {engine.env.world_size} "
           f"processes ({engine.env.launcher})",
           evidence={**engine.timings, "layout": plan.layout.model_dump(mode="json"),
                     "device": str(engine.device), "launcher": engine.env.launcher})


def _checkpointer(engine: Engine, run: RunDir) -> Checkpointer:
    """Checkpoint saving and resuming for this run (docs/ckpt.md)."""
    opts = engine.options
    options = CkptOptions(interval=opts.checkpoint_interval(engine.plan), keep=opts.ckpt_keep,
                          level=opts.ckpt_level, resume=opts.resume, final=opts.ckpt_final,
                          chunk_delay_s=opts.inject_ckpt_delay)
    return Checkpointer(engine, run.ckpt, options, emit=lambda **kw: _event(engine, run, **kw),
                        data_fingerprint=source_fingerprint(engine.loader.source))


def _run(engine: Engine, run: RunDir) -> int:
    plan, opts, g = engine.plan, engine.options, engine.groups
    _start(engine, run)
    ckpt = _checkpointer(engine, run)
    first = ckpt.resume()
    engine.grads.attach_modules(engine.chunks)  # ZeRO 1/2: the next forward waits per bucket
    control = Control(run.control, engine.env.rank)
    control.install_signal_handlers()
    gc.disable()  # collected on every rank at the same steps, so no rank stalls the others
    timer = StepTimer(engine.device)
    steps = opts.steps or plan.training.steps
    if engine.env.rank == 0 and first:
        print(f"resumed from the checkpoint of step {first} in {run.ckpt}"
              + (f"; continuing to step {steps}" if first < steps else
                 f": already at step {steps}, nothing to train (raise --steps, or use a new "
                 "--run-dir to start over)"), flush=True)
    tokens_per_step = plan.training.global_batch * plan.model.seq_len
    flops = model_flops(plan.model, plan.training.global_batch)
    peak = plan.cluster.gpu.peak_tflops * 1e12
    progress = ProgressReporter(steps, enabled=opts.progress and engine.env.rank == 0,
                                log_interval=opts.log_interval)
    code = EXIT_OK
    with progress:
        for step in range(first, steps):
            timer.start_step()
            result = train_step(engine, step, timer)
            if not result.finite:
                _event(engine, run, kind="nan", severity="critical", step=step + 1,
                       message="non-finite gradient norm: stopped before the optimizer step",
                       evidence={"grad_norm": str(result.grad_norm), "loss": str(result.loss)})
                code = EXIT_CRITICAL
                break
            norm, threshold, lr, loss = result.grad_norm, result.threshold, result.lr, result.loss
            if opts.gc_interval and (step + 1) % opts.gc_interval == 0:
                gc.collect()
            timings = timer.end_step()
            reporter = g.is_last_stage and g.tp_rank == 0
            vectors = gather_rank_vectors(timings, loss if reporter else None, engine.env.world_size)
            if engine.env.rank == 0:
                rec = build_record(vectors, step=step + 1, grad_norm=norm, clip_threshold=threshold,
                                   lr=lr, tokens=tokens_per_step, flops_per_step=flops,
                                   peak_flops_per_device=peak)
                run.append_record(run.metrics, rec)
                progress.update(rec)
            decision = control.poll()
            if decision.checkpoint or decision.stop:
                _event(engine, run, kind="signal" if decision.signal else "control",
                       step=step + 1, severity="warning" if decision.stop else "info",
                       message=_decision_message(decision),
                       evidence={"checkpoint": decision.checkpoint, "halt": decision.halt,
                                 "signal": decision.signal})
            ckpt.poll()
            reason = ckpt.due(step + 1, requested=decision.checkpoint or decision.stop)
            if reason:
                ckpt.save(step + 1, reason, lr=lr)
            if decision.stop:
                code = EXIT_WARNING
                break
        else:
            if ckpt.due(steps, final=True) and first < steps:
                ckpt.save(steps, "final", lr=learning_rate(plan.training, steps - 1))
    engine.grads.wait_params()  # parameter all-gathers of the last step
    ckpt.close()  # a save in flight is finished and committed before the process exits
    _event(engine, run, kind="stop", severity="info" if code == EXIT_OK else "warning",
           message=f"training process exited with code {code}", evidence={"code": code})
    return code


@dataclass
class StepResult:
    """What one optimizer step produced on this rank."""

    loss: float | None
    """This rank's mean loss over the step's micro-batches (None off the last stage)."""
    grad_norm: float
    """Global gradient norm before clipping (identical on every rank)."""
    threshold: float
    """Clipping threshold in force."""
    lr: float
    """Learning rate used."""
    finite: bool
    """False when the norm was NaN/Inf: the optimizer step was not taken."""


def train_step(engine: Engine, step: int, timer: StepTimer) -> StepResult:
    """One optimizer step: micro-batches, DP reduction, norm, NaN stop, clipping, update."""
    loss = forward_backward(engine, step, timer)
    timer.add("comm_wait", engine.grads.finish())
    norm = engine.optimizer.grad_norm()
    threshold = engine.clipper.threshold()
    lr = learning_rate(engine.plan.training, step)
    if not math.isfinite(norm):
        return StepResult(loss, norm, threshold, lr, finite=False)
    for guard in engine.update_guards:  # a checkpoint still copying this state to host
        guard()
    timer.add("comm_wait", engine.optimizer.step(lr, clip_coef=min(1.0, threshold / (norm + 1e-6))))
    engine.clipper.update(norm)
    return StepResult(loss, norm, threshold, lr, finite=True)


def _decision_message(decision) -> str:
    parts = []
    if decision.checkpoint:
        parts.append("checkpoint requested: saving at this step boundary")
    if decision.halt or decision.signal:
        parts.append("saving a checkpoint, then halting at this step boundary"
                     + (" on a signal" if decision.signal else " on a control/halt request"))
    return "; ".join(parts)

