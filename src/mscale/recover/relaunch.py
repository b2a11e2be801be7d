"""The relaunch: which command, rewritten how (command.py), or a SLURM requeue.

The command is the one ``train`` recorded in its ``start`` event (``evidence["launch"]``: argv,
cwd, plan, local, nodes, slurm) or the one given with ``RecoverOptions.command``, and only what
the recovery changes is touched (command.py says which words). Under SLURM a job whose nodes,
plan and checkpoint are unchanged is simply requeued; a batch script is reused only when it can
run unchanged (same world, same plan, latest checkpoint), since the ``srun`` line inside it
names the old world and plan; otherwise the rewritten ``srun`` line is submitted with ``--wrap``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from mscale.hostlist import collect_hostlist, expand_hostlist
from mscale.recover.command import (Change, batch_note, command_exclusions, kept_out_nodes,
                                    option_value, resume_of, rewrite_command, rewrite_train)
from mscale.recover.diagnose.evidence import evidence_of
from mscale.recover.diagnose.read import JSONL_TAIL_BYTES, read_jsonl_tail
from mscale.runs.rundir import RunDir

Runner = Callable[[list[str]], tuple[int, str]]
"""Runs a command and returns (exit code, stdout); injected by tests in place of scontrol."""

MAX_EVENTS_BYTES = 1 << 30
"""How far back `recorded_launch` reads for a start older than the diagnosis's tail."""


@dataclass
class Launch:
    """How the failed attempt was started, as ``train`` recorded it (or as far as it is known)."""

    argv: list[str]
    """The worker's command line (``mscale train PLAN --run-dir R ...``)."""
    cwd: str | None = None
    """Directory it ran in (relative paths in ``argv`` are relative to it)."""
    plan: str | None = None
    """Absolute path of the plan file it ran."""
    local: int = 0
    """``--local N``'s N, 0 when another launcher started the workers."""
    nodes: list[str] = field(default_factory=list)
    """Node names in node order."""
    slurm: dict | None = None
    """``job_id``, ``job_name``, ``nodelist``, ``nnodes`` under SLURM, else None."""
    launcher: str = "unknown"
    """``local``, ``slurm``, ``torchrun`` (the start event's launcher)."""


def recorded_launch(run: RunDir) -> Launch | None:
    """The launch of the run's last ``train`` start, None when no start event recorded one (or
    the record is damaged: the events file is evidence, never a reason for recover to crash).
    Read as the diagnosis reads it: the file's tail, a bad line skipped (it stopped recover
    with exit 3); the whole file only when a start is older than the tail."""
    events, problems = read_jsonl_tail(run.events, JSONL_TAIL_BYTES)
    starts = _train_starts(events)
    if not starts and problems:  # cut short (or a segment unreadable): look further back
        starts = _train_starts(read_jsonl_tail(run.events, MAX_EVENTS_BYTES)[0])
    if not starts:
        return None
    ev = evidence_of(starts[-1])
    rec = ev.get("launch")
    if not isinstance(rec, dict) or not isinstance(rec.get("argv"), list) or not rec["argv"]:
        return None
    local, nodes, slurm = rec.get("local"), rec.get("nodes"), rec.get("slurm")
    return Launch(argv=[str(a) for a in rec["argv"]], cwd=_text(rec.get("cwd")),
                  plan=_text(rec.get("plan")),
                  local=local if isinstance(local, int) and local > 0 else 0,
                  nodes=[str(n) for n in nodes] if isinstance(nodes, list) else [],
                  slurm=slurm if isinstance(slurm, dict) and slurm else None,
                  launcher=str(ev.get("launcher") or ("local" if local else "unknown")))


def _train_starts(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict)
            and e.get("kind") == "start" and e.get("source", "train") == "train"]


def _text(value) -> str | None:
    return value if isinstance(value, str) and value else None


def launcher_of(launch: Launch | None, command: list[str] | None) -> str:
    """``local``, ``slurm`` or ``torchrun``: from the given command's first word, else the
    recorded launch."""
    if command:
        head = os.path.basename(command[0])
        if head in ("srun", "sbatch", "scontrol"):
            return "slurm"
        if head == "torchrun":
            return "torchrun"
        if "--local" in command or any(a.startswith("--local=") for a in command):
            return "local"
    if launch is None:
        return "unknown"
    if launch.local:
        return "local"
    if launch.slurm:
        return "slurm"
    return launch.launcher


def replays_a_rollback(launch: Launch, change: Change) -> bool:
    """Whether the recorded command's ``--resume`` is one this relaunch must change (an earlier
    rollback's step, or ``none``): then SLURM must not requeue or release the job as it is, its
    command would roll the run back again on every restart."""
    fixed = rewrite_train(launch.argv, change, local=False, cwd=launch.cwd)
    return resume_of(fixed) != resume_of(launch.argv)


def scontrol_job(job_id: str, run: Runner) -> dict[str, str]:
    """``scontrol show job -o JOB`` as key → value ({} when SLURM no longer knows the job)."""
    code, out = run(["scontrol", "show", "job", "-o", str(job_id)])
    if code != 0 or not out.strip():
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def job_info(launch: Launch | None, command: list[str] | None,
             run: Runner | None = None) -> dict[str, str]:
    """`scontrol_job` of the recorded SLURM job when the relaunch is made from the recorded
    launch (no ``command`` given), else {}. Read once per recovery: the re-plan must know the
    nodes the job keeps out (`carried_exclusions`) before `relaunch` rewrites it (its ``info``).
    ``run``: `run_quiet` when None."""
    if command or launch is None or launcher_of(launch, None) != "slurm":
        return {}
    job_id = str((launch.slurm or {}).get("job_id") or "")
    return scontrol_job(job_id, run or run_quiet) if job_id else {}


BY_COMMAND = "kept out by the job's own command (its -x/--exclude) before this recovery"
BY_ALLOCATION = "kept out of the job's allocation before this recovery (scontrol's ExcNodeList)"


def carried_exclusions(command: list[str] | None, info: dict[str, str]) -> dict[str, str]:
    """node → why, for the nodes the relaunch keeps out because the job already did, the ones
    quarantine released included (`exclude.with_carried` drops them): the given ``command``'s
    (`command_exclusions`), else the recorded job's ``ExcNodeList`` (``info``, `job_info`).
    The same sources `relaunch` carries into its command, so the re-plan counts what it gets."""
    if command:
        return dict.fromkeys(command_exclusions(command), BY_COMMAND)
    return dict.fromkeys(_excluded_by(info), BY_ALLOCATION)


def run_quiet(cmd: list[str]) -> tuple[int, str]:
    """Run a short SLURM query; a missing binary or a hang is an answer, not an error."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, p.stdout


NO_LAUNCH_NOTE = ("the run recorded no launch command (no train `start` event with its launch), "
                  "so recover has none to run: start the job again yourself (its own command "
                  "resumes it as said above), or run it under `mscale recover supervise -- CMD`")
"""The reason when neither a recorded launch nor a given command says how the job was started."""


def by_hand(plan) -> bool:
    """Whether ``plan`` (a `RecoveryPlan`) can be relaunched, but only by a person: the run
    recorded no launch command. Its verdict stands (the run resumes as it says), but --execute
    has nothing to run, and the report says so rather than "relaunchable" alone."""
    return (not plan.command and plan.verdict in ("relaunchable", "degraded")
            and NO_LAUNCH_NOTE in plan.reasons)


@dataclass
class Relaunch:
    """The command and what the operator should know about it."""

    launcher: str
    command: list[str]
    notes: list[str] = field(default_factory=list)
    refusal: str | None = None
    """Why nothing can be submitted until a person acts (recover's verdict is then
    unrecoverable: a script must not read the run as relaunched)."""


def relaunch(launch: Launch | None, change: Change, ranks_per_node: int,
             command: list[str] | None = None, run: Runner = run_quiet,
             info: dict[str, str] | None = None) -> Relaunch:
    """The relaunch command for ``change``, from ``command`` when given, else the recorded
    launch; an empty command with a note when neither says how the job was started. ``info``:
    the SLURM job as `job_info` read it, which is then not asked again (None: asked here)."""
    launcher = launcher_of(launch, command)
    if command:
        return Relaunch(launcher, rewrite_command(command, change, ranks_per_node),
                        batch_note(command, change))
    if launch is None:
        return Relaunch(launcher, [], [NO_LAUNCH_NOTE])
    if launcher == "local":
        return Relaunch("local", rewrite_train(launch.argv, change, local=True,
                                               cwd=launch.cwd))
    if launcher == "slurm":
        return _slurm(launch, change, ranks_per_node, run, info)
    if launcher == "torchrun":
        nnodes = max(1, change.world // max(1, ranks_per_node))
        cmd = [_torchrun_beside(launch.argv), f"--nnodes={nnodes}",
               f"--nproc-per-node={ranks_per_node}", "--no-python",
               *rewrite_train(launch.argv, change, local=False, cwd=launch.cwd)]
        return Relaunch("torchrun", cmd, ["add your rendezvous flags (--rdzv-endpoint, ...) and "
                                          "run it on each remaining node"])
    return Relaunch(launcher,
                    rewrite_train(launch.argv, change, local=False, cwd=launch.cwd),
                    [f"launcher {launcher!r} unknown: start the workers as before"])


def _torchrun_beside(argv: list[str]) -> str:
    """The torchrun of the environment the job ran in: beside the interpreter its workers
    recorded (``.../bin/python -m mscale.cli.main``), where one is; else ``torchrun`` from PATH.
    A job started as ``.venv/bin/torchrun`` was relaunched as a bare ``torchrun``, not found
    outside the activated environment."""
    if argv and os.path.isabs(argv[0]):
        beside = os.path.join(os.path.dirname(argv[0]), "torchrun")
        if os.access(beside, os.X_OK):
            return beside
    return "torchrun"


def _local_run_dir(argv: list[str], cwd: str | None) -> str | None:
    """The command's ``--run-dir`` as an absolute local path; None for a URL or none given."""
    value = option_value(argv, "--run-dir")
    if not value or "://" in value:
        return None
    return os.path.normpath(os.path.join(cwd or os.getcwd(), value))


QUEUED_AGAIN = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
"""States of a batch job that SLURM put back in the queue itself after the failure (a node
failure with ``--requeue``, an operator's requeue): the job will run again. ``RUNNING`` is not
one: a batch script that runs ``mscale recover --execute`` after its failed ``srun`` (the loop
in docs/recover.md) is the job itself, and requeues itself."""


def _queued_again(job_id: str, info: dict[str, str], change: Change, ranks_per_node: int,
                  nodes_before: int) -> Relaunch:
    """The failed job is queued again: a second submission would train twice into one run
    directory, and ``scontrol requeue`` of a pending job fails. When nothing changes there is
    nothing to do but release it if it is held; when only nodes are to be kept out of the same
    shape, the queued job is told so; anything else needs it cancelled first."""
    state = f"JobState={info.get('JobState')}, Restarts={info.get('Restarts', '?')}"
    # held: a launch failure requeues a batch job held (Reason=launch_failed_requeued_held,
    # Priority=0), as does an operator's hold; such a job never starts by itself
    held = info.get("JobState") == "REQUEUE_HOLD" or info.get("Priority") == "0" \
        or "held" in (info.get("Reason") or "").lower()
    if held:
        state += f", held: Reason={info.get('Reason', '?')}"
    if change.unchanged:
        if held:
            return Relaunch("slurm", ["scontrol", "release", job_id], [
                f"SLURM has queued job {job_id} again itself ({state}): released, it resumes "
                "from the latest checkpoint"])
        return Relaunch("slurm", [], [
            f"SLURM has queued job {job_id} again itself ({state}): when it starts it resumes "
            f"from the latest checkpoint; nothing to submit (`squeue -j {job_id}` shows it)"])
    same_shape = change.plan_path is None and change.resume is None and \
        change.world == nodes_before * ranks_per_node
    if same_shape:
        kept_out = _kept_out(change, info)
        notes = [f"SLURM has queued job {job_id} again itself ({state}): it is kept, told to "
                 f"stay off {collect_hostlist(change.excluded)}"]
        if held:
            notes.append(f"it is held: release it after this (`scontrol release {job_id}`)")
        return Relaunch("slurm", ["scontrol", "update", f"JobId={job_id}",
                                  f"ExcNodeList={collect_hostlist(kept_out)}"], notes)
    return Relaunch("slurm", [], refusal=(
        f"SLURM has queued job {job_id} again itself ({state}), but the relaunch needs a new "
        f"plan or an older checkpoint: cancel it (`scancel {job_id}`) and run `mscale recover` "
        "again; a new job beside it would train twice into one run directory"))


def _excluded_by(info: dict[str, str]) -> list[str]:
    """The nodes ``scontrol show job`` says the job was kept off (``ExcNodeList``)."""
    value = info.get("ExcNodeList") or "(null)"  # scontrol's word for none
    return [] if value == "(null)" else kept_out_nodes(
        value, f"scontrol's ExcNodeList {value!r}", "check `scontrol show job` of the job")


def _kept_out(change: Change, info: dict[str, str]) -> list[str]:
    """The relaunch's exclusions and the job's own, less the nodes back in the pool."""
    return sorted({*change.excluded, *(set(_excluded_by(info)) - set(change.released))})


def _step_left_out(launch: Launch, excluded: list[str]) -> list[str]:
    """The nodes of the job's allocation (``SLURM_JOB_NODELIST``, recorded) that its training
    step (``SLURM_STEP_NODELIST``: the recorded nodes) did not run on, less those the relaunch
    keeps out anyway. Why: a step may have run on fewer nodes than its allocation because the
    batch script's ``srun -x`` kept one out, and SLURM records that -x nowhere recover can
    read (the step's environment, scontrol's ExcNodeList: the allocation's); or the step just
    asked for fewer. Recover cannot tell which, so it says so instead of guessing."""
    nodelist = (launch.slurm or {}).get("nodelist")
    if not isinstance(nodelist, str) or not launch.nodes:
        return []
    try:
        allocation = expand_hostlist(nodelist)
    except ValueError:  # a damaged record: nothing to say about it
        return []
    return sorted(set(allocation) - set(launch.nodes) - set(excluded))


def _slurm(launch: Launch, change: Change, ranks_per_node: int, run: Runner,
           info: dict[str, str] | None) -> Relaunch:
    """requeue when nothing changes, the batch script when it can run as it is, else ``--wrap``
    around the rewritten ``srun`` line."""
    slurm = launch.slurm or {}
    job_id = str(slurm.get("job_id") or "")
    if info is None:
        info = scontrol_job(job_id, run) if job_id else {}
    batch = info.get("BatchFlag") == "1"
    stale = batch and change.resume is None and replays_a_rollback(launch, change)
    replay = batch and not stale  # the job may run again as it is
    if batch and info.get("JobState") in QUEUED_AGAIN:
        if stale:
            return Relaunch("slurm", [], refusal=(
                f"SLURM has queued job {job_id} again itself, but its command carries --resume "
                f"{resume_of(launch.argv)} (an earlier rollback, or none): it would roll the run "
                f"back again: cancel it (`scancel {job_id}`) and run `mscale recover` again"))
        return _queued_again(job_id, info, change, ranks_per_node, len(launch.nodes))
    # Requeue=0 (sbatch --no-requeue, or the site's JobRequeue=0): SLURM refuses the requeue
    # ("Requested operation is presently disabled"), so the script is submitted again instead
    no_requeue = info.get("Requeue") == "0"
    if change.unchanged and replay and not no_requeue:
        return Relaunch("slurm", ["scontrol", "requeue", job_id])
    nnodes = max(1, change.world // max(1, ranks_per_node))
    head = ["sbatch", f"--nodes={nnodes}"]
    # the job's own exclusions too (its #SBATCH --exclude, an earlier recovery's): a command
    # line --exclude replaces the script's, and the bad nodes it kept out would come back
    excluded = _kept_out(change, info)
    if excluded:
        head.append(f"--exclude={collect_hostlist(excluded)}")
    if slurm.get("job_name"):
        head.append(f"--job-name={slurm['job_name']}")
    script = info.get("Command", "")
    same_shape = change.plan_path is None and change.resume is None and \
        change.world == len(launch.nodes) * ranks_per_node
    notes = []
    if replay and no_requeue and change.unchanged:
        notes.append(f"job {job_id} cannot be requeued (Requeue=0: submitted with --no-requeue "
                     "or the cluster's JobRequeue=0): submitted again")
    if replay and same_shape and os.path.isfile(script):
        return Relaunch("slurm", [*head, script], notes)
    if batch and not same_shape:
        notes.append("the batch script names the old world, plan or checkpoint: its srun line "
                     "is resubmitted rewritten with --wrap (its other #SBATCH options are not)")
    elif not info:
        notes.append(f"SLURM no longer knows job {job_id or '?'}: submitted with --wrap")
    idle = _step_left_out(launch, excluded)
    if idle:
        notes.append(f"the job's allocation held {collect_hostlist(idle)}, which its training "
                     "step did not run on: an srun -x inside the batch script leaves no trace "
                     "recover can read, so the relaunch does not keep it out; to keep a node "
                     "out, put it in the script's #SBATCH --exclude or the job's ExcNodeList")
    if info.get("Partition"):
        head.append(f"--partition={info['Partition']}")
    if launch.cwd:
        head.append(f"--chdir={launch.cwd}")
    logs = _local_run_dir(rewrite_train(launch.argv, change, local=False, cwd=launch.cwd),
                          launch.cwd)
    if logs:  # where diagnose looks for SLURM's own lines, not the submitter's directory
        head.append(f"--output={logs}/logs/slurm-%j.out")
    # --kill-on-bad-exit: one failed task ends the step, so a stopped rank cannot hold the job
    # until its time limit after its peers timed out (docs/slurm.md)
    srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks={change.world}",
            f"--ntasks-per-node={ranks_per_node}",
            *rewrite_train(launch.argv, change, local=False, cwd=launch.cwd)]
    return Relaunch("slurm", [*head, f"--ntasks-per-node={ranks_per_node}",
                              "--wrap", shlex.join(srun)], notes)
