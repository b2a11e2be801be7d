"""The relaunch command: the failed job's own command line, rewritten for what recover decided.

Why rewrite rather than compose: the operator's command carries things recover cannot know (the
partition, the time limit, the venv's ``mscale``, test hooks, ``--steps``). So the command is
the one ``train`` recorded in its ``start`` event (``evidence["launch"]``: argv, cwd, plan, local,
nodes, slurm) or the one given with ``RecoverOptions.command``, and only what the recovery
changes is touched: the plan argument (a re-planned plan), ``--local N`` (the new world),
``--resume CKPT`` (a rollback), and the launcher's node flags (``srun``/``sbatch``
``--exclude``/``--nodes``/``--ntasks``, ``torchrun --nnodes``). Under SLURM a job whose nodes,
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

from mscale.ckpt import catalog
from mscale.hostlist import collect_hostlist, expand_hostlist
from mscale.recover.diagnose.evidence import evidence_of
from mscale.recover.diagnose.read import JSONL_TAIL_BYTES, read_jsonl_tail
from mscale.runs.rundir import RunDir

Runner = Callable[[list[str]], tuple[int, str]]
"""Runs a command and returns (exit code, stdout); injected by tests in place of scontrol."""

_FLAGS_WITHOUT_VALUE = {"--json", "--final-ckpt", "--no-final-ckpt", "--allow-batch-change",
                        "--allow-data-change", "--debug", "-h", "--help"}
"""``mscale train`` options that take no value; every other ``--option`` takes one."""


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


@dataclass
class Change:
    """What the relaunch changes."""

    world: int
    """Ranks of the relaunch."""
    nodes: list[str]
    """Nodes it uses, in placement order."""
    excluded: list[str] = field(default_factory=list)
    """Nodes kept out (``--exclude``)."""
    plan_path: str | None = None
    """The re-planned plan, None when the old plan stands."""
    resume: str | None = None
    """Checkpoint to resume from when it is not the latest, else None (``--resume auto``)."""
    allow_batch_change: bool = False
    """The new plan changes the global batch: train must be told it may (its flag)."""
    run_dir: str | None = None
    """The run directory recover diagnosed (absolute, or a URL): the relaunch's ``--run-dir``.
    The recorded one may be relative to the job's directory, or the run may have been moved
    since; either way the relaunch must resume *this* run, not start a fresh one elsewhere."""

    @property
    def unchanged(self) -> bool:
        return not self.excluded and self.plan_path is None and self.resume is None


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


def _train_index(argv: list[str]) -> int | None:
    """Index of the ``train`` word of ``mscale train`` (or ``python -m mscale... train``)."""
    for i, a in enumerate(argv[1:], start=1):
        prev = argv[i - 1]
        if a == "train" and ("mscale" in os.path.basename(prev) or prev.startswith("mscale")):
            return i
    return None


def _plan_index(args: list[str], start: int) -> int | None:
    """Index of the plan (the first positional argument after ``train``)."""
    i = start
    while i < len(args):
        a = args[i]
        if a == "--":
            return i + 1 if i + 1 < len(args) else None
        if a.startswith("-"):
            i += 1 if (a in _FLAGS_WITHOUT_VALUE or "=" in a) else 2
            continue
        return i
    return None


def set_option(args: list[str], flag: str, value: str, start: int = 0) -> list[str]:
    """``args`` with ``flag value`` (or ``flag=value``) set to ``value``, appended if absent.
    Long flags also match their ``=`` form; ``-N 4`` style short flags are matched as given."""
    out = list(args)
    for i in range(start, len(out)):
        if out[i] == flag and i + 1 < len(out):
            out[i + 1] = value
            return out
        if out[i].startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    return out + [flag, value]


def _drop_option(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            i += 2
            continue
        if any(args[i].startswith(f + "=") for f in flags):
            i += 1
            continue
        out.append(args[i])
        i += 1
    return out


def rewrite_train(argv: list[str], change: Change, local: bool,
                  cwd: str | None = None) -> list[str]:
    """The ``mscale train`` part of a command with the new plan, ``--local N``, the diagnosed
    ``--run-dir``, ``--resume`` and ``--allow-batch-change`` (when the plan changes the batch);
    the launcher words before it are left to the caller. ``cwd``: where the command ran (a
    relative ``--resume`` is read there), this process's when None."""
    t = _train_index(argv)
    if t is None:
        return list(argv)
    head, args = argv[: t + 1], argv[t + 1:]
    if change.plan_path is not None:
        p = _plan_index(args, 0)
        if p is None:
            args = [change.plan_path, *args]
        else:
            args[p] = change.plan_path
    if local:
        args = set_option(args, "--local", str(change.world))
    if change.run_dir is not None:
        args = set_option(args, "--run-dir", change.run_dir)
    if change.resume is not None:
        args = set_option(args, "--resume", change.resume)
    elif _stale_rollback(args, change.run_dir, cwd) or resume_of(args) == "none":
        # `none` refuses a run with checkpoints: recover resumes, so the latest it is
        args = set_option(args, "--resume", "auto")
    if change.allow_batch_change and "--allow-batch-change" not in args:
        args = [*args, "--allow-batch-change"]
    return head + args


def option_value(args: list[str], flag: str) -> str | None:
    """The value of the first ``flag value`` or ``flag=value`` in ``args`` (the one `set_option`
    sets), None when absent."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def resume_of(args: list[str]) -> str | None:
    """The value of ``--resume`` in ``args`` (either spelling), None when absent."""
    return option_value(args, "--resume")


def _stale_rollback(args: list[str], run_dir: str | None, cwd: str | None = None) -> bool:
    """Whether ``args`` still carry an earlier recovery's rollback, ``--resume RUN/ckpt/step-N``
    of this run (absolute, or relative to where the command ran), when this recovery resumes
    from the latest: replayed, it would roll the run back to step N again and move the newer
    checkpoints aside. (A path outside the run only starts it: train continues from the run's
    own latest by itself.)"""
    value = resume_of(args)
    if not run_dir or "://" in run_dir or not value or "://" in value \
            or value in ("auto", "none"):
        return False
    path = os.path.normpath(os.path.join(cwd or os.getcwd(), value))
    return catalog.in_run(path, os.path.join(run_dir, "ckpt"))


def replays_a_rollback(launch: Launch, change: Change) -> bool:
    """Whether the recorded command's ``--resume`` is one this relaunch must change (an earlier
    rollback's step, or ``none``): then SLURM must not requeue or release the job as it is, its
    command would roll the run back again on every restart."""
    fixed = rewrite_train(launch.argv, change, local=False, cwd=launch.cwd)
    return resume_of(fixed) != resume_of(launch.argv)


def _slurm_prefix(prefix: list[str], change: Change, ranks_per_node: int) -> list[str]:
    """srun/sbatch words with the node flags of the relaunch."""
    out = _drop_option(prefix, ("-N", "--nodes", "-n", "--ntasks", "-x", "--exclude",
                                "-w", "--nodelist"))
    nodes = max(1, change.world // max(1, ranks_per_node))
    extra = [f"--nodes={nodes}"]
    if os.path.basename(prefix[0]) == "srun":
        extra.append(f"--ntasks={change.world}")
    if change.excluded:
        extra.append(f"--exclude={collect_hostlist(change.excluded)}")
    return out[:1] + extra + out[1:]


def _torchrun_prefix(prefix: list[str], change: Change, ranks_per_node: int) -> list[str]:
    return set_option(prefix, "--nnodes", str(max(1, change.world // max(1, ranks_per_node))))


def rewrite_command(command: list[str], change: Change, ranks_per_node: int) -> list[str]:
    """Any launch command (``srun ... mscale train ...``, ``torchrun ... mscale train ...``,
    ``mscale train ... --local N``) rewritten for ``change``."""
    t = _train_index(command)
    if t is None:
        return _rewrite_batch(command, change, ranks_per_node)
    exe = t - 1
    prefix, train = command[:exe], command[exe:]
    is_local = "--local" in train or any(a.startswith("--local=") for a in train)
    train = rewrite_train(train, change, local=is_local)
    if prefix and os.path.basename(prefix[0]) in ("srun", "sbatch"):
        prefix = _slurm_prefix(prefix, change, ranks_per_node)
    elif prefix and os.path.basename(prefix[0]) == "torchrun":
        prefix = _torchrun_prefix(prefix, change, ranks_per_node)
    return prefix + train


def _rewrite_batch(command: list[str], change: Change, ranks_per_node: int) -> list[str]:
    """``sbatch [...] script.sh`` or ``sbatch [...] --wrap "srun mscale train ..."``: the node
    flags set among sbatch's own options (before the script), the wrapped line rewritten."""
    if not command or os.path.basename(command[0]) not in ("sbatch", "srun"):
        return list(command)
    out = list(command)
    for i, a in enumerate(out):
        if a == "--wrap" and i + 1 < len(out):
            out[i + 1] = shlex.join(rewrite_command(shlex.split(out[i + 1]), change,
                                                    ranks_per_node))
        elif a.startswith("--wrap="):
            out[i] = "--wrap=" + shlex.join(rewrite_command(shlex.split(a[7:]), change,
                                                            ranks_per_node))
    end = next((i for i in range(1, len(out)) if os.path.isfile(out[i])), len(out))
    return _slurm_prefix(out[:end], change, ranks_per_node) + out[end:]


def _batch_note(command: list[str], change: Change) -> list[str]:
    """A batch script keeps its own srun line and plan: say so when they should change."""
    if _train_index(command) is not None or any(a == "--wrap" or a.startswith("--wrap=")
                                                for a in command):
        return []
    if change.plan_path is None and change.resume is None:
        return []
    return ["the batch script's own srun line still names the old world, plan or checkpoint: "
            "submit the rewritten train command instead (or let recover use the recorded one)"]


def scontrol_job(job_id: str, run: Runner) -> dict[str, str]:
    """``scontrol show job -o JOB`` as key → value ({} when SLURM no longer knows the job)."""
    code, out = run(["scontrol", "show", "job", "-o", str(job_id)])
    if code != 0 or not out.strip():
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def run_quiet(cmd: list[str]) -> tuple[int, str]:
    """Run a short SLURM query; a missing binary or a hang is an answer, not an error."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, p.stdout


NO_LAUNCH_NOTE = ("the run recorded no launch command (no train `start` event with its launch): "
                  "recover cannot relaunch it; start the job again yourself, or run it under "
                  "`mscale recover supervise -- CMD`")
"""The reason when neither a recorded launch nor a given command says how the job was started."""


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
             command: list[str] | None = None, run: Runner = run_quiet) -> Relaunch:
    """The relaunch command for ``change``, from ``command`` when given, else the recorded
    launch; an empty command with a note when neither says how the job was started."""
    launcher = launcher_of(launch, command)
    if command:
        return Relaunch(launcher, rewrite_command(command, change, ranks_per_node),
                        _batch_note(command, change))
    if launch is None:
        return Relaunch(launcher, [], [NO_LAUNCH_NOTE])
    if launcher == "local":
        return Relaunch("local", rewrite_train(launch.argv, change, local=True,
                                               cwd=launch.cwd))
    if launcher == "slurm":
        return _slurm(launch, change, ranks_per_node, run)
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
        already = info.get("ExcNodeList") or "(null)"  # scontrol's word for none
        kept_out = sorted({*change.excluded,
                           *(expand_hostlist(already) if already != "(null)" else [])})
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


def _slurm(launch: Launch, change: Change, ranks_per_node: int, run: Runner) -> Relaunch:
    """requeue when nothing changes, the batch script when it can run as it is, else ``--wrap``
    around the rewritten ``srun`` line."""
    slurm = launch.slurm or {}
    job_id = str(slurm.get("job_id") or "")
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
    if change.unchanged and replay:
        return Relaunch("slurm", ["scontrol", "requeue", job_id])
    nnodes = max(1, change.world // max(1, ranks_per_node))
    head = ["sbatch", f"--nodes={nnodes}"]
    if change.excluded:
        head.append(f"--exclude={collect_hostlist(change.excluded)}")
    if slurm.get("job_name"):
        head.append(f"--job-name={slurm['job_name']}")
    script = info.get("Command", "")
    same_shape = change.plan_path is None and change.resume is None and \
        change.world == len(launch.nodes) * ranks_per_node
    if replay and same_shape and os.path.isfile(script):
        return Relaunch("slurm", [*head, script])
    notes = []
    if batch and not same_shape:
        notes.append("the batch script names the old world, plan or checkpoint: its srun line "
                     "is resubmitted rewritten with --wrap (its other #SBATCH options are not)")
    elif not info:
        notes.append(f"SLURM no longer knows job {job_id or '?'}: submitted with --wrap")
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
