"""``mscale train PLAN --local N``: start N worker processes on this machine and watch them.

Each worker runs `mscale.train.worker.run_worker` with torchrun-style variables (RANK, WORLD_SIZE,
LOCAL_RANK, GROUP_RANK, MASTER_ADDR/PORT), the function ``mscale train`` runs under torchrun and
srun, entered without the CLI (`WORKER_ENTRY`: everything was checked here, once); the options
travel as one serialised `TrainOptions` (MSCALE_TRAIN_OPTIONS), never re-parsed. While the workers
start, the console shows how many reached each phase (`startup_phases`, distributed/launch.py).
Ranks are grouped into "nodes" of the plan's gpus_per_node, so node checks and hierarchical
groups behave as on a cluster. If any worker fails, the others are stopped (SIGTERM, then SIGKILL
after a grace period): a dead rank must never leave its peers hanging. SIGINT, SIGTERM and
SIGHUP (a closed terminal or ssh session) to the launcher are forwarded as SIGTERM, which workers
treat as "halt at the next step boundary" (told first which signal it was, so rank 0's records
name the operator's SIGINT or SIGHUP); a second Ctrl-C stops them at once, without a
checkpoint (distributed/stops.py; exit 130, a ``stop`` event that says ``interrupted`` and names
no node: the operator stopped the job, nothing failed). Workers never outlive the launcher: killed, it leaves
them to stop themselves (distributed/lifeline.py, train/worker.py). Its console is best-effort
(distributed/stdio.py): a closed terminal loses the view, never the job or its exit code.

When a worker fails, the launcher knows what no worker can: which rank failed *first*, how
(exit code or signal), and which ranks were still alive (a SIGSTOPped or deadlocked rank never
times out itself — its peers do). It writes that into a ``stop`` event and maps the job's end to
a contract exit code (0–3, or 130 for an interruption); `mscale.distributed.launch` does the
watching.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from mscale.config.plan import Plan, check_training_matches_layout
from mscale.topology.env import NoLauncherError, read_launch_env
from mscale.topology.placement import load_checked_plan
from mscale.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, MscaleError
from mscale.runs.rundir import RunDir
from mscale.runs.targets import check_output
from mscale.distributed.launch import run_local_workers, worker_log_dir
from mscale.distributed.watcher import JobResult
from mscale.train.off_gpu import check_fits_without_gpus
from mscale.train.options import TrainOptions

OPTIONS_ENV = "MSCALE_TRAIN_OPTIONS"

WORKER_ENTRY = "from mscale.train.worker import local_main; local_main()"
"""``python -c`` code of a ``--local`` worker (the plan's path follows): `run_worker` without the
CLI around it. The launcher has checked every input already; through the CLI each worker also
loaded every command module and repeated those checks (the plan, the run directory, the resume
checkpoint's manifest): ~0.06 s of CPU per worker here, beside ~2.5 s for torch."""

WORKER_PRELOAD = ("torch", "mscale.train.worker", "mscale.train.loop")
"""What the fork server imports before it forks the workers (distributed/forkserver.py); plus
``torch._dynamo`` when the plan recomputes activations (`preload_for`)."""


def preload_for(plan: Plan) -> tuple[str, ...]:
    """`WORKER_PRELOAD`, and ``torch._dynamo`` under recompute: torch's non-reentrant
    activation checkpointing imports it on first use (~1.5 s of CPU), once in the server instead
    of once per worker; without recompute no rank imports it."""
    return WORKER_PRELOAD + (("torch._dynamo",) if plan.layout.recompute != "none" else ())


def startup_phases(options: TrainOptions) -> list[tuple[str, str]]:
    """The start-up phases a training worker marks (train/worker.py, train/loop.py), as
    (marker, label): the last is "checkpoint loaded" when the run resumes from one."""
    from mscale.ckpt import catalog

    resumes = options.ckpt.resume not in ("none", "auto") or (
        options.ckpt.resume == "auto" and _has_latest(catalog, RunDir(options.run_dir).ckpt))
    return [("imported", "imported"), ("rendezvous", "rendezvous"),
            ("built", "model built"),  # groups, model chunks, optimizer, data loader
            ("ready", "checkpoint loaded" if resumes else "ready")]


def _has_latest(catalog, root: str) -> bool:
    """Whether ``--resume auto`` loads a checkpoint (latest, or a committed one newer)."""
    try:
        found = catalog.entries(root, sizes=False)
        return catalog.auto_choice(found, catalog.read_latest(root)) is not None
    except (MscaleError, OSError):  # check_before_launch said it all already
        return False


def options_from_env() -> TrainOptions | None:
    """The options a launcher handed this worker, if it was started by ``--local``."""
    raw = os.environ.get(OPTIONS_ENV)
    if not raw:
        return None
    return TrainOptions.model_validate_json(raw)


def check_before_launch(plan_path: str, options: TrainOptions, local: int) -> Plan:
    """Everything that can be checked before a process starts: the plan, the run directory, the
    data file, the process count. Bad input fails here once, not in N workers; under srun or
    torchrun only what is cheap is checked here, the rest by the workers (`_launched`)."""
    from mscale.data.blend import build_splits  # numpy only: the launcher never imports torch

    plan = load_checked_plan(plan_path)
    check_training_matches_layout(plan, plan_path)
    check_output(options.run_dir, "dir", "--run-dir")
    _check_not_a_checkpoint(options.run_dir)
    if not local and _launched():
        return plan  # each worker checks these after the rendezvous (`_launched`)
    data, splits = plan.training.data, None
    if data.kind == "tokens":  # every source opened, its index checked, the splits cut
        try:
            splits = build_splits(data, plan.model.seq_len, plan.training.seed,
                                  plan.model.real_vocab or plan.model.vocab)
        except MscaleError as e:  # an error of the data section, no file of its own: the plan's
            if e.file is None:
                e.file = plan_path
            raise
    _check_same_run(plan, options)
    from mscale.ckpt.resume import check_resume_point

    try:  # a bad --resume or latest: for train that is "could not run" (3); 2 means NaN here
        point = check_resume_point(RunDir(options.run_dir).ckpt, options.ckpt.resume)
    except MscaleError as e:
        e.code = EXIT_BAD_INPUT
        raise
    check_no_layer_dropped(point.manifest if point else None, plan, plan_path,
                           options.ckpt.resume)
    if point is not None and splits is not None:
        _check_same_data(point, splits, options, plan_path)
    world = plan.layout.world_size
    _check_hook_ranks(options, world)
    if local:
        from mscale.distributed.launch import check_local_count

        check_local_count(local, plan, plan_path)
        check_fits_without_gpus(plan, plan_path, local)
    return plan


def _launched() -> bool:
    """Whether srun or torchrun started this process: then the checks of the data and the run
    directory wait for the worker, after the rendezvous, where each is made anyway (the sources
    opened on every rank, the plan change judged by rank 0 and told to all, the checkpoint to
    resume chosen by rank 0 while the others poll) and fails every rank together. Made here
    they cost each of 12,288 ranks a parse of the checkpoint's manifest (at 175B ~430 MB and
    ~2 minutes in schema 1, 5.3 TB read in all; 4.9 MB in schema 2, still 60 GB in all); made
    by rank 0 alone they held the others at the rendezvous, whose timeout is --timeout, until
    they gave up."""
    try:
        read_launch_env()
    except NoLauncherError:
        return False  # the worker says so, with the fix
    return True


def check_no_layer_dropped(manifest, plan: Plan, plan_path: str, resume: str) -> None:
    """A checkpoint of more blocks than the plan's model loads without a missing tensor (the
    loader reads what the model asks for) and trains a truncated model: refused. Fewer blocks
    fail the load itself, naming the tensor."""
    saved = (getattr(manifest, "plan", None) or {}).get("model") if manifest else None
    layers = saved.get("layers") if isinstance(saved, dict) else None
    if isinstance(layers, int) and layers > plan.model.layers:
        raise MscaleError(f"the checkpoint to resume holds {layers} blocks, this plan's model "
                          f"{plan.model.layers}: blocks {plan.model.layers}-{layers - 1} would be "
                          "dropped in silence", file=plan_path, field="model.layers",
                          fix=f"train the checkpoint's model (model.layers: {layers}), or "
                              f"drop --resume {resume} to start this model from scratch")


def _check_same_data(point, splits, options: TrainOptions, plan_path: str) -> None:
    """Refuse now, before a worker builds its model or any line says the run resumed, data
    changed under a restart of the run's own checkpoint (train/resumed.py): the splits opened
    above give the identity the workers would compute (`resumed.split_identity`)."""
    from mscale.train.resumed import check_data_unchanged, is_own, split_identity

    try:
        check_data_unchanged(point.manifest.state, split_identity(*splits), point.path,
                             is_own(point.path, RunDir(options.run_dir).ckpt),
                             options.allow_data_change)
    except MscaleError as e:  # the plan's data section names what it reads now
        e.file = plan_path
        raise


def _check_not_a_checkpoint(run_dir: str) -> None:
    """A checkpoint is no run directory: `ckpt convert`'s HF import writes one wherever it is
    told, and training "in" it started from scratch beside its files, the weights unread."""
    from mscale.ckpt.manifest import COMMITTED, MANIFEST
    from mscale.runs.atomic import fs_and_path

    fs, path = fs_and_path(run_dir)
    if fs.isfile(f"{path}/{MANIFEST}") and fs.isfile(f"{path}/{COMMITTED}"):
        raise MscaleError(f"{run_dir} is a checkpoint ({MANIFEST}, {COMMITTED}), not a run "
                          "directory: training there would start from scratch and leave it "
                          "unread", field="--run-dir",
                          fix=f"to train from it: --resume {run_dir} with a new --run-dir")


def _check_hook_ranks(options: TrainOptions, world: int) -> None:
    """A test hook naming a rank the job does not have would silently never fire. Not checked
    once the run directory has a start event: the hooks are off after attempt 1 (train/faults.py)
    and a relaunch re-planned for fewer ranks keeps the command's flags."""
    from mscale.runs.lock import next_attempt

    for flag, ranks in options.faults.rank_hooks().items():
        bad = sorted(r for r in ranks if not 0 <= r < world)
        if bad and next_attempt(options.run_dir) == 1:
            raise MscaleError(f"{flag} names rank {bad[0]}, but the job has ranks 0-{world - 1}",
                              field=flag, fix=f"name a rank below {world}")


def _check_same_run(plan: Plan, options: TrainOptions) -> None:
    """Refuse now, not in the workers, a plan of another model or recipe than the run's (one
    that trained a step: `runs.history.plan_change_of`)."""
    from mscale.runs.history import plan_change_of

    plan_change_of(RunDir(options.run_dir), plan, allow_batch_change=options.allow_batch_change,
                   allow_data_change=options.allow_data_change)


def launch_job(plan_path: str, plan: Plan, options: TrainOptions, nprocs: int,
               as_json: bool = False) -> int:
    """Run the job on ``nprocs`` local processes; returns its contract exit code."""
    from mscale.distributed.stdio import guard_std_streams
    from mscale.runs.lock import LOCK_HELD_ENV, RunLock, new_run_id

    run = RunDir(options.run_dir)
    run_id = f"local-{new_run_id()}"
    lock = RunLock(run.root, run_id).acquire()  # held for the workers; refused if in use
    lock.start_heartbeat()
    restore_streams = guard_std_streams()  # through the closing line and the --json document
    try:
        return _run_and_report(plan_path, plan, options, nprocs, as_json, run, run_id,
                               {LOCK_HELD_ENV: run_id}, lock)
    finally:
        restore_streams()
        lock.release()


def _run_and_report(plan_path, plan, options, nprocs, as_json, run, run_id, env, lock) -> int:
    logs, temporary = worker_log_dir(options.run_dir, "logs")
    code = None
    try:
        code = _run_workers(plan_path, plan, options, nprocs, as_json, run, run_id, env, logs,
                            lock)
        return code
    finally:
        _tidy_logs(logs, temporary, passed=code == 0)


def stop_notice(name: str) -> str:
    """The launcher's line when the operator first asks the job to stop."""
    return (f"stop requested ({name}): every worker saves a checkpoint at its next step "
            "boundary (none before the first step), then stops; Ctrl-C again to stop now, "
            "without one")


def oversubscription_note(omp: str | None, nprocs: int, cpus: int | None) -> str | None:
    """A note when an inherited OMP_NUM_THREADS gives the workers more threads than the machine
    has cores (many clusters export it): on CPUs each step then waits on threads that take
    turns, 15x slower for the demo at 2 threads a worker on 2 cores (docs/train.md, Threads)."""
    if not omp or not omp.strip().isdigit() or not cpus:
        return None
    threads = int(omp)
    if threads * nprocs <= cpus or threads <= max(1, cpus // nprocs):  # one each is the least
        return None
    return (f"note: OMP_NUM_THREADS={threads} (from the environment) gives {nprocs} workers "
            f"{threads * nprocs} threads on {cpus} cores: on CPUs the steps wait on each other's "
            "threads; unset it to let --local give each worker its share of the cores")


def _tidy_logs(logs: str, temporary: bool, passed: bool) -> None:
    """A remote run directory's workers logged to a local temporary directory: removed after a
    job that ended well, named (on stderr) after one that did not, for the operator to read."""
    if not temporary:
        return
    if passed:
        import shutil

        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"worker logs kept in {logs}", file=sys.stderr, flush=True)


def lock_lost(lock) -> Callable[[], str | None]:
    """The launcher's `LocalJob.abandon`: its workers run under its lock (``LOCK_HELD_ENV``)
    and never look at it, so the launcher does: a lock another job took over (this one was
    stopped past its lease, Ctrl-Z then ``fg``) means two jobs would write one run."""
    return lambda: str(lock.lost).splitlines()[0] if lock.lost is not None else None


def _run_workers(plan_path, plan, options, nprocs, as_json, run, run_id, env, logs,
                 lock) -> int:
    from mscale.train.console import layout_text
    from mscale.train.failure import read_error_files
    from mscale.train.job_watch import (agreed_stop, record_failure, record_interruption,
                                        stopped_by_operator, summary_document)

    say = (lambda m: print(m, file=sys.stderr, flush=True)) if as_json else \
        (lambda m: print(m, flush=True))
    per_node = plan.cluster.gpus_per_node
    workers = f"{nprocs} worker" + ("s" if nprocs != 1 else "")
    say(f"starting {workers} on this machine: {layout_text(plan)}, "
        f"{-(-nprocs // per_node)} node(s) of {min(per_node, nprocs)}; run directory "
        f"{options.run_dir}, logs in {logs}")
    note = oversubscription_note(os.environ.get("OMP_NUM_THREADS"), nprocs, os.cpu_count())
    if note:
        say(note)
    env.update({OPTIONS_ENV: options.model_dump_json(), "MSCALE_RUN_ID": run_id})
    started = time.time()  # error files older than this are an earlier attempt's
    worker_args = [plan_path if "://" in plan_path else os.path.abspath(plan_path)]
    result: JobResult = run_local_workers(nprocs, per_node, worker_args, logs, env,
                                          rank0_to_stderr=as_json, entry=WORKER_ENTRY,
                                          preload=preload_for(plan),
                                          phases=startup_phases(options),
                                          node_names=plan.cluster.node_names(),
                                          stop_notice=stop_notice, abandon=lock_lost(lock))
    if result.abandoned:  # the run is another job's now: nothing more is written into it
        say(f"train: stopped: {result.abandoned}")
        return EXIT_BAD_INPUT
    errors = read_error_files(run, since=started, run_id=run_id)
    if stopped_by_operator(result, errors):
        say(record_interruption(run, result, run_id, logs))
        result.code = EXIT_INTERRUPTED
    elif result.failed_rank is not None and agreed_stop(run, result, run_id, errors):
        result.failed_rank = None  # rank 0's stop line and event already say why
    elif result.failed_rank is not None:
        say(record_failure(run, plan, result, run_id, logs, errors, started))
    if as_json:
        print(json.dumps(summary_document(run, run_id, result), indent=2, default=str), flush=True)
    return result.code
