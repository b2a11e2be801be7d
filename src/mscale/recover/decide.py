"""One recovery, end to end: diagnose → checkpoint → exclusions → re-plan → relaunch.

`plan_recovery` only reads (and, under SLURM, re-checks suspect nodes with preflight): it is the
dry run `mscale recover RUN` prints. `apply_plan` writes what the plan needs before a relaunch
(the re-planned plan, the data window to skip, a pin on the chosen checkpoint, the decision
document ``RUN/recover/decision-NNNN.json`` and one ``recover`` event) and moves nothing it
cannot undo; `launch` runs the command. The verdict is the exit code: 0 relaunch as it was, 1
relaunch with less (fewer nodes, an older checkpoint, a skipped data window, idle nodes, another
batch), 2 a human must act; ``reasons`` says why, one sentence per fact.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass

from mscale.ckpt.options import CkptOptions
from mscale.config.plan import Plan
from mscale.config.records import DataSkip, Event
from mscale.errors import EXIT_INTERRUPTED, MscaleError
from mscale.hostlist import collect_hostlist
from mscale.recover import room, stages, start_over
from mscale.recover.checkpoints import UNCOMMITTED, names_damaged
from mscale.recover.child import Child
from mscale.recover.exclude import released, slurm_names, with_carried
from mscale.recover.diagnose.classify import unplaced_link
from mscale.recover.decision import (CheckpointChoice, Diagnosis, Exclusions, RecoveryPlan,
                                     Replan, Verify)
from mscale.recover.liveness import refuse_if_live
from mscale.recover.recheck import Rechecker, failure_time
from mscale.recover.command import Change, option_value
from mscale.recover.relaunch import (Launch, carried_exclusions, job_info, recorded_launch,
                                     relaunch)
from mscale.recover.replan import plan_nodes
from mscale.runs.atomic import fs_and_path, write_json_atomic
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan

_DECISION = re.compile(r"decision-(\d{4,})\.json$")


@dataclass
class RecoverOptions:
    """How `mscale recover` decides and acts."""

    execute: bool = False
    """Carry the plan out (`apply_plan` + `launch`); the default only prints it."""
    allow_batch_change: bool = False
    """May the re-plan change the global batch when no layout keeps it on the remaining nodes."""
    recheck: bool = True
    """Re-check suspect nodes with preflight before excluding them (`recover.recheck`)."""
    verify: Verify = "quick"
    """Checkpoint verification before trusting one: ``quick`` (manifest, sizes) or ``full``."""
    command: list[str] | None = None
    """The launch command to rewrite, when the run's start event did not record one (or to use
    another, e.g. the sbatch line a supervisor runs)."""


def check_run_dir(run_dir: str) -> RunDir:
    """Bad input (exit 3) unless ``run_dir`` is a run directory: it exists and holds the files
    a training run leaves (events.jsonl or plan.yaml). Each way of missing says which."""
    if run_dir.startswith("memory://"):  # fsspec's memory filesystem dies with its process
        raise MscaleError("a memory:// run directory lives only inside the process that wrote "
                          "it; nothing is left to recover", file=run_dir, field="RUN_DIR",
                          fix="train with --run-dir on a shared filesystem or an object store")
    fs, root = fs_and_path(run_dir)
    if fs.isfile(root):
        raise MscaleError("this is a file, not a run directory", file=run_dir, field="RUN_DIR",
                          fix="give the directory that `mscale train --run-dir` wrote")
    if not fs.isdir(root):
        raise MscaleError("run directory not found", file=run_dir, field="RUN_DIR",
                          fix="give the --run-dir of a training run")
    run = RunDir(run_dir)
    if not any(fs.isfile(fs_and_path(u)[1]) for u in (run.events, run.plan)):
        raise MscaleError("not a run directory (no events.jsonl or plan.yaml)", file=run_dir,
                          field="RUN_DIR", fix="give the --run-dir that `mscale train` wrote")
    return run


def _run_plan(run: RunDir, launch: Launch | None) -> tuple[Plan, str]:
    """The plan the failed attempt ran: the run's plan.yaml (train records the resolved plan
    there), else the recorded launch's plan file."""
    for url in (run.plan, launch.plan if launch else None):
        if url and fs_and_path(url)[0].isfile(fs_and_path(url)[1]):
            return load_checked_plan(url), url
    raise MscaleError("the run has no plan.yaml and its start event names no plan file",
                      file=run.root, fix="recover needs the plan the job ran")


def _absolute(url: str | None) -> str | None:
    """A local path made absolute: the relaunch runs in the job's directory, not recover's."""
    return url if url is None or "://" in url else os.path.abspath(url)


def ranks_per_node(plan: Plan) -> int:
    return min(plan.cluster.gpus_per_node, plan.layout.world_size)


def plan_recovery(run_dir: str, opts: RecoverOptions | None = None) -> RecoveryPlan:
    """Decide how to recover the run's last failure; reads only (see the module docstring).
    A run a live job holds is refused (`recover.liveness.RunInUse`, exit 3) before anything is
    read: its files are mid-write."""
    opts = opts or RecoverOptions()
    run = check_run_dir(run_dir)
    refuse_if_live(run_dir)
    diagnosis = stages.diagnose(run_dir)
    choice = stages.choose_checkpoint(run, diagnosis, verify=opts.verify)
    launch = recorded_launch(run)
    plan, plan_url = _failed_plan(run, launch, diagnosis, choice)
    finished = diagnosis.symptom == "finished"  # nothing to recover: no re-check, no re-plan
    checker = None
    if opts.recheck and not finished:
        checker = Rechecker(run, plan, launch.plan if launch and launch.plan else plan_url,
                            launch, since=failure_time(run))
    ran = plan_nodes(plan, launch.nodes if launch else None)
    exclusions, back, info = _exclusions(run, diagnosis, checker, plan, plan_url == run.plan,
                                         launch, opts.command)
    reasons: list[str] = []
    refusal = rp = skip = None
    try:
        if not finished:
            rp = stages.replan(run, plan, exclusions, ran=ran,
                               allow_batch_change=opts.allow_batch_change, write=False)
    except MscaleError as e:
        rp, refusal = None, f"no layout fits the remaining nodes: {e.message}"
    if not finished:
        skip = stages.data_skip_for(diagnosis, choice, skips=stages.read_data_skips(run))
    if skip is not None:  # the window is that many steps of the failed run's batch
        skip = skip.model_copy(update={"global_batch": plan.training.global_batch})
    change = Change(world=rp.world if rp else plan.layout.world_size,
                    nodes=rp.nodes if rp else list(launch.nodes if launch else []),
                    excluded=list(exclusions.nodes), plan_path=_absolute(rp.plan_path if rp
                                                                         else None),
                    resume=None if choice.is_latest else _absolute(choice.path),
                    allow_batch_change=bool(rp and rp.batch_changed),
                    run_dir=_absolute(run_dir), released=back)
    how = relaunch(launch, change, ranks_per_node(plan), command=opts.command, info=info)
    refusal = "; ".join(r for r in (refusal, how.refusal,
                                     *_relaunch_refusals(run, diagnosis, choice, opts, launch))
                        if r) or None
    if finished:  # exit 0 (docs/recover.md): a finished run is no failure, nor degraded
        verdict, reasons = "finished", ["the run finished: nothing to recover"]
    else:
        # the job's own command as it ran, not this recovery's rewrite of it (a re-plan file,
        # exclusions, a rollback --resume): an unrecoverable verdict writes none of those
        own = opts.command or (launch.argv if launch and launch.argv else None)
        start = None if choice.path else start_over.for_run(
            run, plan, choice, diagnosis.failed_step or 0, opts.command, launch and launch.argv)
        verdict = _verdict(diagnosis, choice, exclusions, rp, skip, refusal, reasons,
                           rerun=own, start=start)
        reasons += exclusions.notes + _recheck_notes(checker, diagnosis, exclusions) + how.notes
    return RecoveryPlan(
        run_dir=run_dir, verdict=verdict, diagnosis=diagnosis, checkpoint=choice,
        exclusions=exclusions, replan=rp, data_skip=skip.model_dump(mode="json") if skip else None,
        launcher=how.launcher,
        command=[] if verdict == "unrecoverable" or finished else how.command, reasons=reasons,
        cwd=launch.cwd if launch else None)


def _failed_plan(run: RunDir, launch: Launch | None, diagnosis: Diagnosis,
                 choice: CheckpointChoice) -> tuple[Plan, str]:
    """`_run_plan`, and when there is none because the job stopped before it started training
    (no checkpoint, no plan.yaml), an error that names that cause rather than the missing file."""
    try:
        return _run_plan(run, launch)
    except MscaleError as e:
        fs, plan_file = fs_and_path(run.plan)
        never_started = choice.path is None and not fs.isfile(plan_file)
        if not never_started:  # a plan.yaml that does not load: its own error says why
            raise
        first = f" {diagnosis.evidence[0].source}: {diagnosis.evidence[0].text}" \
            if diagnosis.evidence else ""
        raise MscaleError(f"{e.message}: the job stopped before it started training. "
                          f"{diagnosis.summary}{first}", file=run.root,
                          fix="fix that cause and start the job again (nothing was trained "
                              "and no checkpoint written, so there is nothing to recover)"
                          ) from None


def _relaunch_refusals(run: RunDir, diagnosis: Diagnosis, choice: CheckpointChoice,
                       opts: RecoverOptions, launch: Launch | None) -> list[str]:
    """Why the relaunch would fail again however it is launched: a full disk that still lacks
    room for one checkpoint (`room.shortfall`), or a damaged checkpoint outside this run."""
    out = []
    if diagnosis.symptom == "disk_full" and (full := room.shortfall(
            run, choice.path, _ckpt_keep(opts.command, launch.argv if launch else None),
            pinned=not choice.is_latest)):
        out.append(full)
    if diagnosis.damaged_checkpoint and names_damaged(run, diagnosis) is None:
        out.append(f"the relaunch failed reading {diagnosis.damaged_checkpoint}, which is not "
                   f"one of this run's checkpoints ({diagnosis.damaged_error}): resume from "
                   "another one (--resume), then run recover again")
    return out


def _exclusions(run: RunDir, diagnosis: Diagnosis, checker: Rechecker | None, plan: Plan,
                is_run_plan: bool, launch: Launch | None, command: list[str] | None
                ) -> tuple[Exclusions, list[str], dict[str, str]]:
    """This recovery's exclusions with the nodes the job itself keeps out folded in
    (`exclude.with_carried`), the nodes quarantine released, and the SLURM job as scontrol
    showed it (asked once: the relaunch reuses it). The job's own count: a relaunch that asked
    for one of them would ask for more nodes than it may use, and srun refuses it; and a suspect
    among them is not re-checked (it stays out whatever a re-check says). Every name is the
    one the attempt ran under (SLURM's, under srun: `exclude.slurm_names`)."""
    ran = launch.nodes if launch else None
    back = released(run, time.time(), slurm_names(plan, ran))
    info = job_info(launch, command)
    carried = carried_exclusions(command, info)
    exclusions = stages.decide_exclusions(
        run, diagnosis, recheck=checker, plan=plan if is_run_plan else None, ran=ran,
        kept={n: why for n, why in carried.items() if n not in back and (not ran or n in ran)})
    return with_carried(exclusions, carried, back, ran), back, info


def _ckpt_keep(*commands: list[str] | None) -> int:
    """The ``--ckpt-keep`` the relaunch runs with: the first command that sets it (the one
    given to recover, then the job's recorded train command: a given ``sbatch job.sh`` holds
    none, its script does), else the default."""
    for command in commands:
        value = option_value(command or [], "--ckpt-keep")
        if value and value.isdigit():
            return int(value)
    return CkptOptions.model_fields["keep"].default


def _recheck_notes(checker: Rechecker | None, diagnosis: Diagnosis,
                   exclusions: Exclusions) -> list[str]:
    """What the re-check found that the exclusions do not show: suspects kept because they
    re-checked healthy, and those that could not be re-checked."""
    if checker is None:
        return ["suspect nodes not re-checked (--no-recheck)"] if diagnosis.suspect_nodes else []
    healthy = sorted(n for n, why in checker.answers.items()
                     if why is None and n not in exclusions.nodes)
    kept = [f"{collect_hostlist(healthy)} re-checked healthy by preflight: kept"] if healthy \
        else []
    return kept + checker.notes


def _verdict(diagnosis: Diagnosis, choice: CheckpointChoice, exclusions: Exclusions,
             rp: Replan | None, skip: DataSkip | None, refusal: str | None,
             reasons: list[str], rerun: list[str] | None = None,
             start: start_over.StartOver | None = None) -> str:
    """The verdict, appending one sentence per fact behind it to ``reasons``. ``rerun``: the
    job's own launch command, for the operator to run again once a cause only they can fix is
    fixed; ``start``: whether a run without a checkpoint may start over (`start_over.judge`)."""
    refused = []
    if diagnosis.symptom == "bad_input" or diagnosis.cls == "user_code":
        # not "run recover again": it judges this same failed attempt until a new one runs
        again = f": {shlex.join(rerun)}" if rerun else " with its own command"
        refused.append(f"{diagnosis.summary} — relaunching would fail the same way: fix the "
                       f"code or input, then start the job again{again}")
    if refusal:
        refused.append(refusal)
    progress = diagnosis.failed_step or 0
    # an operator's interruption without a checkpoint (a second Ctrl-C: exit 130) chose to lose
    # its steps; a failure, a scancel whose grace ran out or a halt did not, and damaged
    # checkpoints passed over are never the operator's choice. A save the Ctrl-C cut short is
    # left uncommitted (train.md): it never was a checkpoint, so passing it over loses nothing
    chosen_loss = (diagnosis.cls == "none" and diagnosis.symptom == "stopped"
                   and diagnosis.exit_code == EXIT_INTERRUPTED
                   and all(r.get("why") == UNCOMMITTED for r in choice.rejected))
    fresh = (choice.path is None and progress > 0 and not chosen_loss and start is not None
             and start.allowed)
    if choice.path is None and (progress > 0 or choice.rejected) and not (chosen_loss or fresh):
        refused.append(f"no usable checkpoint ({choice.reason}) and the run had reached step "
                       f"{progress}" + (f" ({start.why})" if start else "")
                       + ": restarting from step 0 is a human's call "
                       f"({start_over.how(choice)})")
    if refused:
        reasons += refused
        return "unrecoverable"
    degraded = _degradations(choice, exclusions, rp, skip)
    if choice.path is None and progress > 0 and chosen_loss:
        degraded.append(f"the stop saved no checkpoint: steps 1-{progress} are trained again, "
                        "from step 0")
    reasons += degraded
    if diagnosis.link_suspects:  # a slow link watch could not place: said, nobody excluded
        reasons.append(unplaced_link(diagnosis.link_suspects))
    if fresh:  # said plainly: the relaunch trains those steps again
        reasons.append(start.why)
    if not degraded:
        at = f"step {choice.step}" if choice.path else "step 0 (no checkpoint yet" + (
            ")" if fresh else ", none lost)")
        reasons.append(f"relaunch as before, from {at}")
    if diagnosis.symptom == "disk_full":  # no node to exclude: the same filesystem comes back
        reasons.append("the filesystem was full: free space (or keep fewer checkpoints) before "
                       "the relaunch, or it fails again at its next checkpoint")
    if diagnosis.rule == "data_store_down":  # the data's store, not the run's filesystem
        reasons.append("the remote data store stopped answering (training.data): check that it "
                       "answers before the relaunch, or raise training.data.remote_retry_s if "
                       "its outages outlast the retries")
    elif diagnosis.cls == "storage" and diagnosis.symptom == "crash":  # nor here: the filesystem
        reasons.append("the storage failed (an I/O error, a read-only filesystem, a permission): "
                       "check the filesystem of the run directory and its checkpoints before "
                       "the relaunch, or it fails the same way")
    if diagnosis.symptom == "damaged_checkpoint":  # no node to exclude: the bytes are wrong
        reasons.append(f"{diagnosis.damaged_checkpoint} is damaged on disk: the storage's "
                       "fault, not a node's (check the filesystem; `mscale ckpt verify` reads "
                       "every chunk of a checkpoint)")
    return "degraded" if degraded else "relaunchable"


def _degradations(choice: CheckpointChoice, exclusions: Exclusions, rp: Replan | None,
                  skip: DataSkip | None) -> list[str]:
    out = []
    if rp is not None:
        why = {**exclusions.carried, **exclusions.reasons}
        gone = [n for n in exclusions.kept_out if n not in rp.nodes]
        out.append(f"{len(gone)} node(s) kept out: {collect_hostlist(gone)} ("
                   + "; ".join(f"{n}: {why.get(n, '?')}" for n in gone) + ")")
        cost = ""
        if rp.old_step_time_s and rp.new_step_time_s is not None:
            pct = (rp.new_step_time_s / rp.old_step_time_s - 1) * 100
            cost = f", predicted step time {pct:+.0f}%"
        out.append(f"re-planned for {rp.world} ranks: {rp.old_layout} -> {rp.layout}{cost}")
        if rp.unused_nodes:
            out.append(f"healthy node(s) left idle: {collect_hostlist(rp.unused_nodes)} (no "
                       "layout uses them with the same global batch)")
        if rp.batch_changed:
            out.append(f"global batch changed to {rp.global_batch} (--allow-batch-change)")
    if choice.path is not None and choice.rollback:
        passed = ", ".join(f"{r.get('name')} ({r.get('why')})" for r in choice.rejected)
        out.append(f"rolled back to step {choice.step}" + (f", passing over {passed}"
                                                            if passed else ""))
    if skip is not None:
        out.append(f"data of {skip.skip_steps} step(s) after step {skip.after_step} skipped"
                   + (f" ({skip.reason})" if skip.reason else ""))
    return out


def _next_decision(run: RunDir) -> str:
    fs, root = fs_and_path(run.recover)
    found = [int(m.group(1)) for p in (fs.ls(root, detail=False) if fs.isdir(root) else [])
             if (m := _DECISION.search(p.rsplit("/", 1)[-1]))]
    return f"{run.recover}/decision-{max(found, default=0) + 1:04d}.json"


def apply_plan(plan: RecoveryPlan) -> str:
    """Write what the relaunch needs; returns the decision document's URL. An unrecoverable
    plan writes only its decision and event (what was refused and why). A run a live job holds
    now (started since the plan was made) is refused before anything is written."""
    refuse_if_live(plan.run_dir)
    run = RunDir(plan.run_dir)
    if plan.verdict not in ("unrecoverable", "finished"):
        _write_replan(run, plan)
        if plan.data_skip:
            stages.record_data_skip(run, DataSkip.model_validate(plan.data_skip))
        if plan.checkpoint.path and not plan.checkpoint.is_latest:  # the relaunch names it
            what = "rollback target" if plan.checkpoint.rollback else "resume point"
            stages.pin_checkpoint(run, plan.checkpoint.path,
                                  f"{what} chosen by recover ({plan.checkpoint.reason})")
    url = _next_decision(run)
    # its time dates what it let back (`exclude.let_back`) against later quarantine entries
    write_json_atomic(url, {**plan.to_json(), "time": time.time()})
    severity = {"relaunchable": "info", "degraded": "warning", "unrecoverable": "critical",
                "finished": "info"}
    d = plan.diagnosis
    run.append_record(run.events, Event(
        source="recover", kind="recover", severity=severity[plan.verdict],
        step=plan.checkpoint.step, ranks=d.suspect_ranks, nodes=plan.exclusions.nodes,
        message=f"{plan.verdict}: {d.summary}" + (f"; {plan.reasons[0]}" if plan.reasons else ""),
        evidence={"decision": url.rsplit("/", 1)[-1], **plan.to_json()}))
    return url


def _write_replan(run: RunDir, plan: RecoveryPlan) -> None:
    """Write the re-planned plan the dry run described; the same inputs give the same layout,
    and a different one is refused rather than launched."""
    if plan.replan is None or plan.replan.plan_path is None:
        return
    rec = recorded_launch(run)
    old, _ = _run_plan(run, rec)
    rp = stages.replan(run, old, plan.exclusions, ran=plan_nodes(old, rec.nodes if rec else None),
                       allow_batch_change=plan.replan.batch_changed, write=True)
    if rp is None or rp.layout != plan.replan.layout:
        raise MscaleError("the re-plan changed since the dry run", file=run.root,
                          fix="run `mscale recover` again and act on its new plan")
    if rp.plan_path != plan.replan.plan_path:
        was, now = _absolute(plan.replan.plan_path), _absolute(rp.plan_path)
        plan.command = [now if a == was else a for a in plan.command]
        plan.replan = rp


def launch(plan: RecoveryPlan, stdout=None) -> int:
    """Run the relaunch command in the directory the job was started from; its exit code (for
    sbatch/requeue: the submission's, the job runs on). ``stdout``: where its output goes
    (``--json`` sends it to stderr, since stdout carries the document)."""
    if not plan.command:
        raise MscaleError("no relaunch command" + (": the run is unrecoverable"
                                                   if plan.verdict == "unrecoverable" else ""),
                          file=plan.run_dir, fix="see the reasons in the report")
    cwd = plan.cwd if plan.cwd and os.path.isdir(plan.cwd) else None
    # its own process group, recover's Ctrl-C passed on: the job halts with a checkpoint
    return Child(plan.command, cwd=cwd, stdout=stdout, field="command",
                 fix="check that the launcher is installed and on PATH").wait()
