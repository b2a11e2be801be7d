"""A launch command rewritten for a relaunch: only the words recover changes, by argv surgery.

The command is the failed job's own (recorded by ``train`` or given to recover): it carries what
recover cannot know (the partition, the time limit, the venv's ``mscale``, test hooks,
``--steps``). So only these are touched: the plan argument (a re-planned plan), ``--local N``
(the new world), ``--run-dir`` (the run recover diagnosed), ``--resume CKPT`` (a rollback; an
earlier rollback's path or ``none`` back to ``auto``), ``--allow-batch-change``, and the
launcher's node flags (``srun``/``sbatch`` ``--exclude``/``--nodes``/``--ntasks``, ``torchrun
--nnodes``). Which command to rewrite, and whether SLURM requeues instead, is relaunch.py.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from mscale.ckpt import catalog
from mscale.errors import MscaleError
from mscale.hostlist import collect_hostlist, expand_hostlist

FLAGS_WITHOUT_VALUE = {"--json", "--final-ckpt", "--no-final-ckpt", "--allow-batch-change",
                        "--allow-data-change", "--debug", "-h", "--help"}
"""``mscale train`` options that take no value; every other ``--option`` takes one."""


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
    released: list[str] = field(default_factory=list)
    """Nodes back in the pool (quarantine no longer holds them: expired, or cleared by hand;
    `exclude.released`): dropped from the exclusions the command or the job already had,
    which are otherwise kept."""

    @property
    def unchanged(self) -> bool:
        return not self.excluded and self.plan_path is None and self.resume is None


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
            i += 1 if (a in FLAGS_WITHOUT_VALUE or "=" in a) else 2
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


def _attached(word: str, flag: str) -> str | None:
    """The value of a short flag written with it (``-xnode9``, ``-N2``), else None."""
    short = len(flag) == 2 and not flag.startswith("--")
    return word[2:] if short and word.startswith(flag) and len(word) > 2 else None


def _drop_option(args: list[str], flags: tuple[str, ...]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        if args[i] in flags:
            i += 2
            continue
        if any(args[i].startswith(f + "=") or _attached(args[i], f) for f in flags):
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


EXCLUDE_FILE_BYTES = 1 << 20
"""Largest ``--exclude`` file read (SLURM reads node names from a value holding a ``/``)."""


def _excluded_in(args: list[str]) -> list[str]:
    """The nodes ``-x``/``--exclude`` name in srun/sbatch words (any spelling: ``-x N``,
    ``-xN``, ``--exclude=N``; repeated; a value with a ``/`` is a file of names, as SLURM reads
    it). One that cannot be read is bad input: dropped, the nodes it kept out would come back."""
    out: list[str] = []
    for i, a in enumerate(args):
        value = args[i + 1] if a in ("-x", "--exclude") and i + 1 < len(args) else \
            a.split("=", 1)[1] if a.startswith(("-x=", "--exclude=")) else _attached(a, "-x")
        if value:
            out += _exclude_value(value)
    return out


def _exclude_value(value: str) -> list[str]:
    fix = "write the nodes to keep out as a SLURM hostlist (--exclude=node[3,9]) in the command"
    text = value
    if "/" in value:
        try:
            with open(value, encoding="utf-8") as f:
                text = ",".join(f.read(EXCLUDE_FILE_BYTES).split())
        except (OSError, UnicodeDecodeError) as e:
            raise MscaleError(f"the command's --exclude file {value} cannot be read "
                              f"({e.__class__.__name__}): recover would drop the nodes it keeps "
                              "out", field="CMD", fix=fix) from None
    return kept_out_nodes(text, f"the command's --exclude {value!r}", fix)


def kept_out_nodes(text: str, what: str, fix: str) -> list[str]:
    """The nodes of a hostlist that keeps nodes out of the job (``what`` names where it was
    read); one that does not parse is bad input, never read as none: the nodes it kept out would
    come back."""
    try:
        return expand_hostlist(text) if text else []
    except ValueError as e:
        raise MscaleError(f"{what} is not a SLURM hostlist ({e}): recover would drop the nodes "
                          "it keeps out", field="CMD", fix=fix) from None


def _slurm_prefix(prefix: list[str], change: Change, ranks_per_node: int) -> list[str]:
    """srun/sbatch words with the node flags of the relaunch."""
    out = _drop_option(prefix, ("-N", "--nodes", "-n", "--ntasks", "-x", "--exclude",
                                "-w", "--nodelist"))
    nodes = max(1, change.world // max(1, ranks_per_node))
    extra = [f"--nodes={nodes}"]
    if os.path.basename(prefix[0]) == "srun":
        extra.append(f"--ntasks={change.world}")
    # the nodes the command already kept out stay out (the user's, an earlier recovery's)
    excluded = sorted({*change.excluded, *(set(_excluded_in(prefix)) - set(change.released))})
    if excluded:
        extra.append(f"--exclude={collect_hostlist(excluded)}")
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
    end = batch_script_index(out)
    return _slurm_prefix(out[:end], change, ranks_per_node) + out[end:]


def batch_script_index(command: list[str]) -> int:
    """Where a ``sbatch`` command's batch script is, else its length: its first word that is
    neither an option nor an option's value (sbatch's own options come before it; after it,
    the script's arguments). An option's value may name a file too: ``--exclude
    /etc/bad-nodes job.sh``, ``-o /logs/existing.out job.sh``."""
    for i in range(1, len(command)):
        if not command[i].startswith("-") and not _takes_value(command[i - 1]):
            return i
    return len(command)


SBATCH_BARE_FLAGS = frozenset({
    "-h", "--help", "-H", "--hold", "-Q", "--quiet", "-W", "--wait", "-v", "--verbose",
    "-V", "--version", "-O", "--overcommit", "-s", "--oversubscribe", "-k", "--no-kill",
    "--exclusive", "--requeue", "--no-requeue", "--parsable", "--test-only", "--use-min-nodes",
    "--contiguous", "--spread-job", "--ignore-pbs", "--get-user-env", "--nice", "--propagate",
    "--reboot"})
"""sbatch's options that take no value, or take one only after ``=`` (``--exclusive=user``);
every other option written alone takes the next word (sbatch(1))."""


def _takes_value(word: str) -> bool:
    """Whether the word after ``word`` is its value: an option without ``=`` (or a short one
    with nothing attached) that is not a bare flag."""
    if not word.startswith("-") or word == "-" or "=" in word:
        return False
    if not word.startswith("--") and len(word) > 2:
        return False  # -xnode3, -N2: the value is attached
    return word not in SBATCH_BARE_FLAGS


def command_exclusions(command: list[str]) -> list[str]:
    """The nodes a launch command keeps out, where `rewrite_command` reads them (and carries
    them into the relaunch): the ``-x``/``--exclude`` of its ``srun``/``sbatch`` words, and of
    a ``--wrap``'d line; sorted, none for other launchers."""
    t = _train_index(command)
    if t is not None:
        prefix = command[:t - 1]
        slurm = bool(prefix) and os.path.basename(prefix[0]) in ("srun", "sbatch")
        return sorted(set(_excluded_in(prefix))) if slurm else []
    if not command or os.path.basename(command[0]) not in ("sbatch", "srun"):
        return []
    out = set(_excluded_in(command[:batch_script_index(command)]))
    for i, a in enumerate(command):
        wrapped = command[i + 1] if a == "--wrap" and i + 1 < len(command) else \
            a[7:] if a.startswith("--wrap=") else None
        if wrapped:
            out.update(command_exclusions(shlex.split(wrapped)))
    return sorted(out)


def batch_note(command: list[str], change: Change) -> list[str]:
    """A batch script keeps its own srun line and plan: say so when they should change."""
    if _train_index(command) is not None or any(a == "--wrap" or a.startswith("--wrap=")
                                                for a in command):
        return []
    if change.plan_path is None and change.resume is None:
        return []
    return ["the batch script's own srun line still names the old world, plan or checkpoint: "
            "submit the rewritten train command instead (or let recover use the recorded one)"]
