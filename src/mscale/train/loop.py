"""The training loop: one optimizer step at a time, with timing, metrics, control and stops.

Exit codes of a training process (docs/train.md):
  0  finished every step
  1  stopped early at a step boundary on request (control/halt, SIGTERM, SIGUSR1, SIGINT, SIGHUP)
  2  stopped before the optimizer step because the loss or gradients were NaN/Inf
  3  bad input, or crashed (the traceback is in RUN_DIR/logs/rank<N>.error.json)
  130  interrupted without a checkpoint: a second Ctrl-C, or a stop before the first step
"""

from __future__ import annotations

import gc
import json
import sys
import time

from mscale.ckpt import catalog
from mscale.ckpt.checkpointer import Checkpointer
from mscale.config.plan import Plan
from mscale.distributed.init import init_distributed
from mscale.distributed.startup import mark_phase
from mscale.errors import EXIT_BAD_INPUT, EXIT_CRITICAL, EXIT_OK, EXIT_WARNING
from mscale.planner.flops import model_flops
from mscale.runs.atomic import write_text_atomic
from mscale.runs.rundir import RunDir
from mscale.topology.env import LaunchEnv, check_node_matches
from mscale.topology.placement import placement_for
from mscale.train.announce import (announce, announce_resume, event, plan_change_event,
                                   say)
from mscale.train.boundary import at_boundary
from mscale.train.console import Summary, checkpoint_line, stop_line
from mscale.train.control import Control
from mscale.train.data import (DataIdentity, check_same_data_everywhere,
                               source_fingerprint)
from mscale.train.engine import Engine, build_engine
from mscale.train.metrics import build_record, gather_rank_vectors
from mscale.train.options import TrainOptions
from mscale.train.progress import ProgressReporter
from mscale.train.resumed import check_data_unchanged, is_own
from mscale.train.schedule import learning_rate
from mscale.train import tensorboard, trace
from mscale.train.evaluate import evaluate
from mscale.train.launch import check_no_layer_dropped
from mscale.train.session import (RunSession, Start, agree_on_rank0, claim_start, from_rank0,
                                  open_session, record_changed_plan)
from mscale.train.step import job_loss, train_step
from mscale.train.timers import StepTimer
from mscale.train.stall import noticing
from mscale.train.waiting import rank0_waiting


def train(plan: Plan, options: TrainOptions, env: LaunchEnv) -> int:
    """Run one training process to completion; returns its exit code (see module docstring).

    Exceptions propagate: `train/worker.py` is the process's edge that turns any of them into an
    error file, one console line and exit code 3.
    """
    if options.steps:
        plan = plan.model_copy(update={"training": with_steps(plan.training, options.steps)})
    check_node_matches(plan, env)  # before joining: a wrong world size would wait there
    t0 = time.perf_counter()
    init_distributed(env, options.timeout_s)
    joined_s = time.perf_counter() - t0
    mark_phase("rendezvous")  # a --local launcher's console shows it apart from the build
    session = open_session(RunDir(options.run_dir), env)
    start = claim_start(session, plan, env, options.allow_batch_change, options.allow_data_change)
    engine = build_engine(plan, env, options, attempt=session.attempt, skips=start.skips)
    engine.timings["init_process_group_s"] = joined_s + engine.timings.get(
        "init_process_group_s", 0.0)
    mark_phase("built")
    return _run(engine, session, start)


def with_steps(training, steps: int):
    """``--steps N``: the run is N steps long, and its LR schedule is laid over them — warm-up
    scaled by the same factor — so a shortened run decays to min_lr like the full one would
    (docs/train.md). The plan.yaml written into the run directory records the N."""
    if steps == training.steps:
        return training
    warmup = round(training.warmup_steps * steps / training.steps) if training.warmup_steps else 0
    return training.model_copy(update={"steps": steps, "warmup_steps": min(warmup, steps)})


def _data_identity(engine: Engine) -> DataIdentity:
    """What the data is (train/data.py), read by rank 0 and told to every rank: a source that is
    not a prepared folder costs two 1 MiB reads, which 12,288 ranks would otherwise make 12,288
    times over the same files at the start; and every rank must reach the same verdict on a
    resume (a changed source stops the job on all of them at once)."""
    rank = engine.env.rank
    data = agree_on_rank0(lambda: source_fingerprint(engine.loader.source), rank)
    doc = from_rank0({"checksum": data.checksum, "sources": data.sources} if rank == 0
                     else None, rank)
    check_same_data_everywhere(engine.loader.source)
    return DataIdentity(doc["checksum"], doc["sources"])


def _checkpointer(engine: Engine, s: RunSession) -> Checkpointer:
    """Checkpoint saving and resuming for this run (docs/ckpt.md)."""
    data = _data_identity(engine)
    return Checkpointer(engine.live_rank(), s.run.ckpt, engine.options.ckpt,
                        emit=lambda **kw: _checkpoint_event(engine, s, kw),
                        data_fingerprint=data.checksum, data_sources=data.sources,
                        data_position=engine.loader.consumed_before,
                        write_hooks=engine.faults.write_hooks, lock_lost=s.lock_lost)


def _check_resume(engine: Engine, s: RunSession, ckpt: Checkpointer, point) -> None:
    """Rank 0, on the checkpoint chosen to resume (`ckpt.resume.ResumePoint`, None for a fresh
    run), before it is loaded and before any line says the run resumed: a plan that would drop
    its blocks, and data changed under a restart of the run's own checkpoint, are refused."""
    if point is None:
        return
    check_no_layer_dropped(point.manifest, engine.plan,
                           (engine.options.launch or {}).get("plan") or s.run.plan,
                           engine.options.ckpt.resume)
    check_data_unchanged(point.manifest.state, DataIdentity(ckpt.fingerprint, ckpt.data_sources),
                         point.path, is_own(point.path, s.run.ckpt),
                         engine.options.allow_data_change)


def _checkpoint_event(engine: Engine, s: RunSession, fields: dict) -> None:
    """The checkpointer's events (rank 0, maybe from its writer thread), commits and failures
    also on the console."""
    event(s, **fields)
    line = checkpoint_line(fields.get("kind", ""), fields.get("message", ""),
                           fields.get("evidence") or {})
    if line:
        say(engine, line)


def _run(engine: Engine, s: RunSession, start: Start) -> int:
    plan = engine.plan
    announce(engine, s, start)
    ckpt = _checkpointer(engine, s)
    first = ckpt.resume(check=lambda point: _check_resume(engine, s, ckpt, point))
    if ckpt.resumed_state is not None:  # the data continues where the checkpoint was
        st = ckpt.resumed_state
        engine.loader.resume_from(st.step, st.samples, st.counts_skips)
    announce_resume(engine, s, ckpt, first)
    if first < plan.training.steps:  # the start goes ahead: now the plan is the run's
        written = record_changed_plan(s, plan, engine.env)
        if written is not None and start.change is not None:  # rank 0, a deferred change
            event(s, **plan_change_event(start.change, written))
    mark_phase("ready")
    control = Control(s.run.control, engine.env.rank)
    for name, when in control.waiting():
        since = time.strftime("%H:%M:%S", time.localtime(when)) if when else "before the start"
        say(engine, f"{s.run.control}/{name} was made before this attempt started (at "
             f"{since}): it {_WAITING[name]} at the first step boundary (if it was meant for an "
             "earlier attempt, remove it and start again)")
    control.install_signal_handlers()
    gc.disable()  # collected on every rank at the same steps, so no rank stalls the others
    summary = Summary(first_step=first)
    code, stop = _loop(engine, s, ckpt, control, first, summary)
    engine.param_buffer.wait()  # parameter all-gathers of the last step
    engine.loader.close()
    with rank0_waiting(engine, ckpt, "the stop" if stop else "the end of the run"):
        ckpt.close()  # a save in flight is finished and committed before the process exits
    code, stop = _kept_at_the_end(engine, ckpt, code, stop)
    figures = _finish(engine, s, code, stop, summary, control.signal_name)
    s.release()
    if engine.options.json_summary and engine.env.rank == 0:
        print(json.dumps({"run_dir": s.run.root, **figures}, indent=2, default=str), flush=True)
    return code


def _kept_at_the_end(engine: Engine, ckpt: Checkpointer, code: int, stop):
    """Collective, after `Checkpointer.close`: a run whose last save (the final one, or a halt's)
    failed stops with exit 3 and says so, since the steps since ``latest`` die with it; a full
    disk found by the final save does too. Returns the (code, stop) to finish with."""
    ended = stop[1] if stop else engine.plan.training.steps
    why = ckpt.unsaved_end(ended) if engine.env.rank == 0 and code in (EXIT_OK, EXIT_WARNING) \
        else None
    why = from_rank0(why or (ckpt.fatal if code == EXIT_OK else None), engine.env.rank)
    if not why:
        return code, stop
    return EXIT_BAD_INPUT, ("abort", ended, why)


def _loop(engine: Engine, s: RunSession, ckpt: Checkpointer, control: Control, first: int,
          summary: Summary) -> tuple[int, tuple[str, int, str] | None]:
    """Steps ``first`` .. the end; returns (exit code, (reason, step, detail) of an early stop)."""
    opts = engine.options
    progress = ProgressReporter(engine.plan.training.steps,
                                enabled=opts.progress and engine.env.rank == 0,
                                log_interval=opts.log_interval,
                                stream=sys.stderr if opts.json_summary else sys.stdout)
    scalars = _scalar_log(engine, s)
    if first == 0:  # the baseline every later held-out loss is compared with
        baseline = _evaluate_if_due(engine, 0, control)
        if baseline is not None and baseline.stopped_after is not None:
            if scalars is not None:
                scalars.close()
            return _stopped_before_training(s)
        if baseline is not None:  # no step record holds it: an event does (docs/data.md)
            event(s, kind="info", step=0, message=f"held-out loss before training: "
                   f"{baseline.loss:.4f}", evidence={"eval_loss": baseline.loss,
                                                     "eval_s": round(baseline.seconds, 4)})
        if baseline is not None and scalars is not None:
            scalars.scalar("eval/loss", baseline.loss, 0)
            scalars.scalar("eval/perplexity", baseline.perplexity, 0)
    try:
        with progress, noticing(lambda line: say(engine, line), opts.timeout_s,
                                enabled=engine.env.rank == 0) as stall:
            return _steps(engine, s, ckpt, control, first, summary, progress, scalars, stall)
    finally:
        if scalars is not None:
            scalars.close()


def _stopped_before_training(s: RunSession) -> tuple[int, tuple[str, int, str]]:
    """A stop signal ended the baseline evaluation: the job stops before step 1, which would
    otherwise train and be saved, and the run, resumed past step 0, never had its baseline."""
    detail = "nothing trained or saved; the same command starts the run again, baseline first"
    event(s, kind="signal", step=0, severity="warning", message="stop signal before step 1",
          evidence={"checkpoint": False, "halt": False, "signal": True})
    return EXIT_WARNING, ("signal", 0, detail)


def _scalar_log(engine: Engine, s: RunSession):
    """Rank 0's TensorBoard writer (train/tensorboard.py), when the training file asks for it."""
    if engine.env.rank != 0 or not engine.plan.training.tensorboard:
        return None
    log, why_not = tensorboard.open_log(s.run.root, s.attempt,
                                        warn=lambda line: say(engine, line))
    if why_not:
        say(engine, why_not)
    return log


def _note_new_epochs(engine: Engine, s: RunSession, step: int, seen: dict[str, int]) -> None:
    """Rank 0: a line and an event when a source of real data runs out and starts its next
    epoch (a new shuffle of it; docs/data.md). Pure index arithmetic over one global batch."""
    samples = getattr(engine.loader.source, "samples", None)
    if samples is None:
        return
    loader = engine.loader
    first = loader.start_of(step)
    for url, epoch in samples.latest_epochs(first, engine.plan.training.global_batch).items():
        if epoch > seen.setdefault(url, epoch):  # the first step of an attempt sets the bar
            message = f"data: {url} ran out and started epoch {epoch + 1} at step {step + 1}"
            say(engine, message)
            event(s, kind="info", step=step + 1, message=message,
                   evidence={"source": url, "epoch": epoch + 1})
            seen[url] = epoch


def _evaluate_if_due(engine: Engine, step: int, control: Control):
    """The held-out loss before the first step of a fresh run, every ``eval.interval`` steps and
    at the last step (collective); None when none is due. One a stop signal ended early (its
    ``stopped_after`` set, on every rank) has no loss."""
    interval = engine.plan.training.eval.interval
    if engine.eval_loader is None or not (step % interval == 0
                                          or step == engine.plan.training.steps):
        return None
    result = evaluate(engine, engine.eval_loader, engine.plan.training.eval.batches,
                      stop_signalled=control.stop_signalled)
    when = f"at step {step}" if step else "before training"
    if result.stopped_after is not None:
        say(engine, f"eval {when} left after {result.stopped_after} of "
             f"{engine.plan.training.eval.batches} held-out batches on a stop signal: no "
             f"held-out loss recorded ({result.seconds:.1f} s); stopping "
             + ("before the first step" if step == 0 else "at the step boundary"))
        return result
    say(engine, f"eval {when}: loss {result.loss:.4f}, perplexity "
         f"{result.perplexity:,.2f} ({engine.plan.training.eval.batches} held-out batches, "
         f"{result.seconds:.1f} s)")
    return result


def _steps(engine: Engine, s: RunSession, ckpt: Checkpointer, control: Control, first: int,
           summary: Summary, progress: ProgressReporter, scalars,
           stall) -> tuple[int, tuple[str, int, str] | None]:
    """The steps themselves (`_loop` holds the progress display, TensorBoard log and the line
    said while a step stalls, train/stall.py)."""
    plan, opts, g = engine.plan, engine.options, engine.groups
    steps = plan.training.steps
    timer = StepTimer(engine.device)
    tokens_per_step = plan.training.global_batch * plan.model.seq_len
    flops = model_flops(plan.model, plan.training.global_batch)
    peak = plan.cluster.gpu.peak_tflops * 1e12
    saving = False  # a save started at the last boundary: its host copy overlaps this step
    trace_next = False  # an operator asked for a timeline (control/trace)
    epochs: dict[str, int] = {}  # source → the latest epoch a step has read
    for step in range(first, steps):
        every = opts.trace_every
        timer.start_step(trace=trace_next or bool(every and (step + 1) % every == 0))
        t0 = time.perf_counter()
        result = train_step(engine, step, timer, before_update=ckpt.before_update)
        if step == first and engine.compiled:
            say(engine, f"step {step + 1} built the compiled kernels in "
                 f"{time.perf_counter() - t0:.1f} s")
        if not result.finite:
            loss = job_loss(engine, result)
            event(s, kind="nan", severity="critical", step=step + 1,
                   message="non-finite gradient norm: stopped before the optimizer step",
                   evidence={"grad_norm": str(result.grad_norm), "loss": str(loss)})
            return EXIT_CRITICAL, ("nan", step + 1, f"loss {loss}")
        flags = {"checkpoint": True} if saving else {}
        if opts.gc_interval and (step + 1) % opts.gc_interval == 0:
            gc.collect()
            flags["gc"] = True  # watch masks steps every rank paused on together
        timings = timer.end_step()
        held_out = _evaluate_if_due(engine, step + 1, control)  # between steps: not in their times
        reporter = g.is_last_stage and g.tp_rank == 0
        vectors = gather_rank_vectors(timings, result.device_loss if reporter else None,
                                      engine.env.world_size)
        if engine.env.rank == 0:
            rec = build_record(vectors, step=step + 1, grad_norm=result.grad_norm,
                               clip_threshold=result.threshold, lr=result.lr,
                               tokens=tokens_per_step, flops_per_step=flops,
                               peak_flops_per_device=peak, extra=flags)
            _report_step(s, rec, held_out, summary, progress)
            stall.finished(step + 1)
            if scalars is not None:
                scalars.record(rec)
            _note_new_epochs(engine, s, step, epochs)
        if timer.events is not None:  # every rank traced this step: the same decision
            _write_trace(engine, s, step + 1, timer.events)
        after = at_boundary(engine, s, ckpt, control, step, result.lr)
        if after.stop is not None:
            return after.stop
        saving, trace_next = after.saving, after.trace
    if ckpt.due(steps, final=True) and first < steps:
        with rank0_waiting(engine, ckpt, f"the final save of step {steps}"):
            ckpt.save(steps, "final", lr=learning_rate(plan.training, steps - 1))
    return EXIT_OK, None


def _report_step(s: RunSession, rec, held_out, summary: Summary,
                 progress: ProgressReporter) -> None:
    """Rank 0: the step's `metrics.jsonl` record, with the held-out loss when one was taken,
    appended, counted in the closing summary and shown on the progress display."""
    if held_out is not None and held_out.stopped_after is None:  # none for one left early
        rec.eval_loss, rec.eval_perplexity = held_out.loss, held_out.perplexity
        rec.extra["eval_s"] = round(held_out.seconds, 4)
    s.journal.append(s.run.metrics, rec)
    summary.add(rec)
    progress.update(rec)


_WAITING = {"halt": "saves a checkpoint and stops", "checkpoint": "saves a checkpoint",
            "trace": "records a timeline"}
"""What a request left waiting before the start does (`Control.waiting`), in words."""


def _write_trace(engine: Engine, s: RunSession, step: int, events) -> None:
    """Collective: gather this step's timeline to rank 0, which writes it (train/trace.py)."""
    plan, env = engine.plan, engine.env
    limit = trace.events_limit(engine.micro_batches, plan.layout.vpp)
    ranks = trace.traced_ranks(plan.layout, engine.options.trace_ranks)
    rows = trace.collect(events, limit, ranks)
    if env.rank != 0:
        return
    places = trace.rank_places(plan.layout, plan.cluster.node_names(),
                               placement_for(plan).node)
    path = "/".join([s.run.trace, f"step-{step:06d}.json"])
    write_text_atomic(path, trace.dumps(trace.chrome_trace(rows, step, places)))
    event(s, kind="info", step=step, severity="info",
           message=f"timeline of step {step} written: {path}", evidence={"trace": path})


def _finish(engine: Engine, s: RunSession, code: int, stop, summary: Summary,
            signal_name: str | None) -> dict:
    """The stop event and the operator's closing line. ``signal_name``: the stop signal this
    rank received, if any."""
    latest = catalog.read_latest(s.run.ckpt) if engine.env.rank == 0 else None
    latest_path = catalog.join(s.run.ckpt, latest) if latest else None
    figures = {**summary.as_dict(), "code": code, "last_checkpoint": latest_path,
               "run_id": s.run_id, "attempt": s.attempt}
    if stop:
        reason, step, detail = stop
        figures["reason"] = reason
        if detail:  # e.g. "the disk is full": under srun this event may be the only record
            figures["detail"] = detail
        if reason == "signal" and signal_name:
            figures["signal"] = signal_name
        say(engine, stop_line(reason, step, None if reason == "abort" else s.run.events, detail,
                               signal_name if reason == "signal" else None))
    else:
        say(engine, "done: " + summary.line(latest_path, s.run.root))
    event(s, kind="stop", severity="info" if code == EXIT_OK else "warning",
           step=summary.last.step if summary.last else summary.first_step,
           message=f"training process exited with code {code}"
           + (f" ({stop[0]})" if stop else ""), evidence=figures)
    return figures
