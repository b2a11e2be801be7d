"""What ``mscale watch TARGET`` names, and how its ranks are laid out.

A target is a run directory, a run's ``metrics.jsonl`` (that run), or a metrics ``.jsonl`` of
another trainer. A path that does not exist yet is resolved by its name, so a live watch started
before the scheduler has placed the job can wait for it; ``--once`` refuses it (`require_run`).
The layout (rank → TP/PP/DP position and node) comes from the run's plan, read again for each
attempt (a relaunch may run another layout), with any field a flag gives replaced; without a plan
(another trainer's metrics) from the flags alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from mscale.errors import MscaleError
from mscale.hostlist import expand_hostlist
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan
from mscale.watch.layout import JobLayout


@dataclass(frozen=True)
class Target:
    """What ``mscale watch TARGET`` names: a run directory, or a metrics file."""

    url: str
    metrics: str
    run: RunDir | None
    """The run directory to act on and read events from; None for a metrics file alone."""
    plan: str | None
    """Where the run's ``plan.yaml`` is or will be (a job writes it after creating the run
    directory, so a watch started at once may not find it yet): see `plan_now`."""

    def plan_now(self) -> str | None:
        """The plan's URL if the file exists now."""
        return _existing(self.plan) if self.plan else None

    def exists(self) -> bool:
        """Whether the path named exists now (a directory, a file, or a JSONL file's
        object-store form): a live watch may be started before the job has created it."""
        fs, path = fs_and_path(self.url)
        return fs.isdir(path) or _exists(self.url)

    def is_run(self) -> bool:
        """Whether a job has been here: a run directory holding any of `NOT_A_RUN` (`train`
        writes them from its start), or a metrics file that exists. An empty, unrelated or
        missing directory is not."""
        if self.run is None:
            return _exists(self.metrics)
        return any(_exists(u) for u in (self.run.plan, self.run.lock, self.metrics,
                                        self.run.events))

    def waiting_for(self) -> str:
        """What a live watch that has seen no record yet is waiting for, in one line. It names
        the path, so a typo in it shows."""
        if self.run is None:
            yet = "" if self.exists() else ": no such file yet"
            return f"waiting for the first record in {self.metrics}{yet}"
        if not self.exists():
            return f"waiting for a run in {self.url}: no such directory yet"
        if not self.is_run():
            return f"waiting for a run in {self.url}: no {NOT_A_RUN} yet"
        return f"waiting for the run's first step: no record in {self.metrics} yet"


NOT_A_RUN = "plan.yaml, lock.json, metrics.jsonl or events.jsonl"
"""What `train` leaves in a run directory from its start: one of them makes a directory a run."""


def require_run(target: Target) -> None:
    """``--once`` judges what is there: a path that does not exist, or a directory no job has
    written to, has nothing, and is more likely a wrong path than a run about to start (a live
    watch waits for it instead)."""
    if not target.exists():
        what = "metrics file" if target.run is None else "run directory or metrics file"
        raise MscaleError(f"no such {what}", file=target.url,
                          fix="check the path: pass the --run-dir of an `mscale train` run or a "
                              "metrics .jsonl file; without --once, watch waits for it to "
                              "appear (a job still queued)")
    if not target.is_run():
        raise MscaleError(f"not a run directory: no {NOT_A_RUN}", file=target.url,
                          fix="pass the --run-dir of an `mscale train` run or a metrics .jsonl "
                              "file; without --once, watch waits for a run to start there")


def resolve_target(url: str) -> Target:
    """A run directory, a run's ``metrics.jsonl`` (treated as its run), or any ``.jsonl``.

    A path that does not exist yet is resolved too, by its name (``.jsonl``: a metrics file
    alone, its plan read once one is written beside it; anything else: a run directory): a live
    watch waits for it, ``--once`` refuses it (`require_run`)."""
    fs, path = fs_and_path(url)
    is_dir = fs.isdir(path)
    if not is_dir and not url.endswith(".jsonl") and fs.exists(path):
        raise MscaleError("not a run directory or a metrics .jsonl file", file=url,
                          fix="pass a run directory (train --run-dir) or a metrics .jsonl file")
    if is_dir or not url.endswith(".jsonl"):
        run = RunDir(url.rstrip("/"))
        return Target(url, run.metrics, run, run.plan)
    parent = RunDir(url.rsplit("/", 1)[0] if "/" in url else ".")
    if url.rsplit("/", 1)[-1] == "events.jsonl" and _exists(url) and _exists(parent.metrics):
        # A run's event log beside its metrics is an easy slip of the operator's tab key; read
        # as metrics it failed on its first line with "a record has no integer step", which
        # sent them to the metrics schema instead of to the path.
        raise MscaleError("this is the run's event log, not its metrics", file=url,
                          fix=f"pass the run directory ({parent.root}) or its metrics.jsonl")
    if not _exists(url):
        return Target(url, url, None, parent.plan)
    plan = _existing(parent.plan)
    if url.rsplit("/", 1)[-1] == "metrics.jsonl" and plan:
        return Target(url, url, parent, plan)
    return Target(url, url, None, plan)


def _existing(url: str) -> str | None:
    fs, path = fs_and_path(url)
    return url if fs.isfile(path) else None


def _exists(url: str) -> bool:
    """A file, or a JSONL file's object-store form (``<file>.d/``, runs/atomic.py)."""
    fs, path = fs_and_path(url)
    return fs.isfile(path) or fs.isdir(path + ".d")


def layout_source(target: Target, tp: int | None = None, pp: int | None = None,
                  dp: int | None = None, ranks_per_node: int | None = None,
                  hostlist: str | None = None,
                  note: Callable[[str], None] = lambda line: None
                  ) -> Callable[[int, dict | None], JobLayout]:
    """How to lay out a job of ``world`` ranks: the run's plan with any field a flag gives
    replaced (`_with_flags`), else every rank on its own (rank-level rules only; nodes and
    stages unknown). A plan that does not load fails now, before any work, unless flags are
    given: they are how to watch a run whose plan.yaml is damaged or of a newer schema, and
    ``note`` says it was set aside."""
    try:  # a bad --hostlist is bad input now, not an internal error when the records come
        hosts = len(expand_hostlist(hostlist)) if hostlist else None
    except ValueError as e:
        raise MscaleError(str(e), field="--hostlist",
                          fix="give the nodes in SLURM syntax, e.g. 'gpu[001-128]'") from None
    flags = (tp, pp, dp, ranks_per_node, hostlist)
    given = any(v is not None for v in flags)
    usable = True
    if target.plan_now():
        try:
            load_checked_plan(target.plan_now())
        except MscaleError as e:
            if not given:
                raise
            usable = False
            note(f"{target.plan_now()} set aside ({e.message.splitlines()[0]}): the layout "
                 "comes from the flags alone")

    def from_plan(world: int, start: dict | None) -> JobLayout | None:
        # read when the first records come, and again for each attempt: the plan may be
        # written after watch starts, and a restarted job may run a new layout (runs/history.py)
        plan = target.plan_now()
        if not plan or not usable:
            return None
        current = load_checked_plan(plan)
        layout = JobLayout.from_plan(current)
        if layout.world != world and target.run is not None:
            earlier = _earlier_layout(target.run, world, current.model.layers)
            if earlier is None and not given:
                raise _no_earlier_layout(target.run, world, layout.world)
            layout = earlier or layout
        return launched_names(layout, start)

    if not given:
        return lambda world, start=None: from_plan(world, start) or JobLayout.flat(world)
    return lambda world, start=None: _with_flags(world, from_plan(world, start), flags, hosts)


def launched_names(layout: JobLayout, start: dict | None) -> JobLayout:
    """The plan's layout with its nodes named as the attempt's ``start`` event records them
    (``evidence.launch.nodes``, in node order: train/session.py `launch_record`). Under srun
    these are SLURM's names, which a plan need not use (a plan of ``gpu[01-04]`` run on
    ``node[1-4]``): a straggler is then named, and quarantined, by the name that recover's
    exclude list and SLURM know. Under ``--local`` they are the plan's own. Another count of
    nodes than the layout's (a relaunch the plan does not describe) leaves the plan's names."""
    launch = ((start or {}).get("evidence") or {}).get("launch")
    nodes = launch.get("nodes") if isinstance(launch, dict) else None
    if (not layout.named or not isinstance(nodes, list) or len(nodes) != len(layout.node_names)
            or not all(isinstance(n, str) and n for n in nodes)):
        return layout
    return replace(layout, node_names=tuple(nodes))


def _with_flags(world: int, base: JobLayout | None, flags: tuple, hosts: int | None) -> JobLayout:
    """``--tp --pp --dp --ranks-per-node --hostlist`` over the plan's layout ``base`` (None: no
    plan, another trainer's metrics): each flag replaces its own field, the rest stay the
    plan's. The plan's ranks per node stay while the job has the plan's ranks, and its node
    names while, besides, no --hostlist or --ranks-per-node renames or refills them: otherwise
    the names are the hostlist's or placeholders, which are never quarantined (a real node's
    name on ranks that did not run there could quarantine a healthy node)."""
    tp, pp, dp, ranks_per_node, hostlist = flags
    t, p = tp or (base.tp if base else 1), pp or (base.pp if base else 1)
    if dp is None and world % (t * p):
        raise MscaleError(f"--tp {t} x --pp {p} = {t * p} does not divide the records' "
                          f"{world} ranks", field="--tp" if tp else "--pp",
                          fix=f"give the job's own sizes: tp·pp·dp = {world}")
    d = dp or max(1, world // (t * p))
    planned = base is not None and t * p * d == base.world  # the plan's job, re-described
    if ranks_per_node:
        per_node = ranks_per_node
    elif planned:
        per_node = base.ranks_per_node
    else:
        if hosts and (t * p * d) % hosts:
            raise MscaleError(f"--hostlist names {hosts} nodes, which {t * p * d} ranks do not "
                              "fill evenly", field="--hostlist",
                              fix="give the job's own nodes in rank order, or --ranks-per-node")
        per_node = max(1, t * p * d // (hosts or 1))
    same_nodes = planned and not hosts and per_node == base.ranks_per_node
    try:
        layout = JobLayout.from_flags(t, p, d, per_node, hostlist,
                                      names=base.node_names if same_nodes else None)
    except MscaleError as e:  # the placement's words are a cluster file's (gpus_per_node)
        if not ranks_per_node or not (e.field or "").startswith("layout"):
            raise
        raise MscaleError(f"--ranks-per-node {ranks_per_node} does not fit the layout "
                          f"tp {t} x pp {p} x dp {d}: {e.message}", field="--ranks-per-node",
                          fix="give the job's ranks per node: a multiple of --tp that divides "
                              "tp·pp·dp") from None
    if base is not None and p == base.pp:  # the plan's pipeline split still holds
        per_step = None if base.micro_batches is None else base.micro_batches * base.dp
        layout = replace(layout, vpp=base.vpp, stage_layers=base.stage_layers,
                         micro_batches=per_step // d if per_step and per_step % d == 0 else None)
    return layout


def _earlier_layout(run: RunDir, world: int, layers: int) -> JobLayout | None:
    """The layout of the newest recorded plan with ``world`` ranks: the records of an attempt
    before a re-plan (recover moved the run from 8 ranks to 6: plan.yaml is the new plan, its
    history in RUN/plans/ keeps the old one). A `--once` read judges the old attempt first.
    Without such a plan (a run directory copied without its plans/), the layout the attempt's
    own ``start`` event records (`_started_layout`)."""
    from mscale.runs.history import plan_history

    for url in reversed(plan_history(run)):
        try:
            layout = JobLayout.from_plan(load_checked_plan(url))
        except MscaleError:  # a damaged history entry: the next older one may still fit
            continue
        if layout.world == world:
            return layout
    return _started_layout(run, world, layers)


def _started_layout(run: RunDir, world: int, layers: int) -> JobLayout | None:
    """The layout of the newest ``start`` event of ``world`` ranks: train records its tp, pp,
    dp, vpp and stage split (``evidence.layout``) and its nodes in rank order
    (``evidence.launch.nodes``), enough to place every rank as its plan did (the rank map is
    derived from them: topology/placement.py). ``layers``: the model's blocks, for the default
    split (the model never changes within a run). The micro-batches per step are left to the
    what-if's estimate: the plan's global batch is not in the event."""
    from mscale.config.layout import even_split
    from mscale.runs.atomic import read_jsonl

    for ev in reversed(read_jsonl(run.events)):
        if ev.get("source", "train") != "train" or ev.get("kind") != "start":
            continue
        evidence = ev.get("evidence") if isinstance(ev.get("evidence"), dict) else {}
        lay, launch = evidence.get("layout"), evidence.get("launch")
        nodes = launch.get("nodes") if isinstance(launch, dict) else None
        if not isinstance(lay, dict) or not isinstance(nodes, list) or not nodes:
            continue
        tp, pp, dp, vpp = (lay.get(k, 1 if k == "vpp" else None) for k in ("tp", "pp", "dp",
                                                                            "vpp"))
        if not all(isinstance(v, int) and v > 0 for v in (tp, pp, dp, vpp)) \
                or tp * pp * dp != world or world % len(nodes):
            continue
        try:
            layout = JobLayout.from_flags(tp, pp, dp, world // len(nodes), vpp=vpp,
                                          names=tuple(str(n) for n in nodes))
        except MscaleError:
            continue
        split = lay.get("stage_layers") or (even_split(layers, pp) if pp > 1 else None)
        return replace(layout, stage_layers=tuple(split) if pp > 1 and vpp == 1 else None)
    return None


def _no_earlier_layout(run: RunDir, world: int, planned: int) -> MscaleError:
    """Records of ``world`` ranks in a run whose plan.yaml has ``planned`` and that recorded
    no layout of that size: mostly a re-planned run copied without its plans/ (and an
    events.jsonl from before start events named their layout)."""
    return MscaleError(
        f"the records have {world} ranks and plan.yaml {planned}, and no layout of {world} "
        f"ranks is recorded: no plan-NNNN.yaml of that size in plans/, no start event of "
        f"events.jsonl naming one", file=run.path("plans"),
        fix="a re-planned run copied without its plans/ folder: copy it along (train records "
            "there every plan the run used); else give the job's --tp and --pp (its nodes are "
            "then unnamed)")


def plan_hints(target: Target, flags_given: bool) -> dict:
    """What the run's plan tells the judge: the step time it predicts (the hang time until the
    run's own is known) and the micro-batches per step (the what-if pipeline model)."""
    if not target.plan_now() or flags_given:
        return {}
    plan = load_checked_plan(target.plan_now())
    hints = {"micro_batches": plan.layout.micro_batches(plan.training.global_batch)}
    step_s = plan.estimate.get("step_time_s")
    if isinstance(step_s, (int, float)) and step_s > 0:
        hints["expected_step_s"] = float(step_s)
    return hints
