"""A layout for the nodes that remain when exclusions shrink the world.

The order of preference, cheapest change first:

1. **Keep tp/pp/vpp and shrink DP** (every other layout setting kept): the model's split is
   unchanged, each replica's share of the global batch grows, and the global batch is kept by
   more micro-batches per step. Needs the remaining ranks to be a multiple of tp·pp, the batch
   divisible by dp·micro_batch, and the layout to fit in memory (fewer ZeRO shards).
2. **The planner's search** on the remaining world with the same global batch: another tp/pp
   when DP alone cannot absorb the loss (e.g. 3 nodes of 2 for tp2·pp2).
3. When no layout uses *all* remaining nodes with that batch: with ``allow_batch_change``, the
   nearest global batch that one does (said so: ``batch_changed``); otherwise the largest subset
   of the remaining nodes that works, the rest left idle in ``unused_nodes`` (the batch, which
   defines the run's recipe, is never changed silently).

The new plan is the planner's (`planner.planfile.make_plan`: placement re-derived, estimate
recomputed) on the cluster narrowed to the nodes used — hostlist and node count — so `--local N`
(which names node ``i`` by the cluster's ``node_names()[i]``, ``gpus_per_node`` ranks each),
srun and the placement all agree on which node is which. Under SLURM the nodes are those the
failed attempt ran on, by SLURM's names (`plan_nodes`), when the plan names them otherwise. The
old plan's checkpoint-interval advice is kept, absent included (the run's save cadence does not
move under it). Before it is returned the plan is loaded back with `load_checked_plan` and
compared with the run's plan by `check_plan_change`, the same checks `train` makes, so a plan
train would refuse is never written. A new global batch passes them only as train passes it
under ``--allow-batch-change``, which the relaunch then adds (recover/relaunch.py); the data
continues from the samples the checkpoint consumed (`ckpt.manifest.TrainState.samples`,
train/data.py).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

from mscale.config.base import dump_yaml
from mscale.config.cluster import ClusterConfig
from mscale.config.layout import LayoutConfig, check_layout
from mscale.config.plan import Plan
from mscale.config.training import TrainingConfig
from mscale.errors import MscaleError
from mscale.hostlist import collect_hostlist, expand_hostlist
from mscale.planner.cost import LayoutCost, Problem, evaluate
from mscale.planner.planfile import make_plan
from mscale.planner.search import Rejects, divisors, search, skeletons
from mscale.recover.decision import Exclusions, Replan
from mscale.runs.atomic import write_text_atomic
from mscale.runs.history import check_plan_change, describe_layout
from mscale.runs.lock import next_attempt
from mscale.runs.rundir import RunDir
from mscale.topology.placement import Placement, load_checked_plan, placement_for

MAX_SEARCHES = 8
"""Planner searches one re-plan may run (each costs about a second at 12,288 GPUs). A node
count with no valid (tp, pp, vpp, dp, micro-batch) at all is passed over by the search's own
enumeration (milliseconds) without counting; past the budget only tp/pp/vpp-keeping layouts are
tried."""
BATCH_CANDIDATES = 8
"""Nearest global batches tried with ``allow_batch_change``."""


@dataclass
class Fit:
    """One layout that runs on ``nodes`` with ``global_batch``."""

    nodes: list[str]
    layout: LayoutConfig
    cost: LayoutCost
    problem: Problem
    how: str
    """How it was found, for the note."""
    unused: list[str] = field(default_factory=list)
    batch_changed: bool = False


def plan_nodes(plan: Plan, ran: list[str] | None = None) -> list[str]:
    """The nodes ``plan`` runs on, in placement order (node ``i`` hosts ranks
    ``i·gpus_per_node …``). ``ran``: the nodes the failed attempt ran on, in that order, as its
    start event recorded them (train records the step's SLURM names under srun, the plan's
    elsewhere); those when there are as many, else the cluster's names. An allocation need not
    hold the plan's names (``gpu[01-04]`` planned, ``node[1-4]`` given): SLURM, the diagnosis,
    the re-check and every exclusion name the node by SLURM's name, so the re-plan must too."""
    names = plan.cluster.node_names()[: placement_for(plan).num_nodes]
    return list(ran) if ran and len(ran) == len(names) else names


def replan(run: RunDir, plan: Plan, exclusions: Exclusions, *,
           ran: list[str] | None = None, allow_batch_change: bool = False,
           write: bool = True) -> Replan | None:
    """The layout for the plan's nodes minus ``exclusions`` (module docstring): this recovery's
    and those the job already kept out (`Exclusions.kept_out`); None when no node of the plan
    is excluded. ``ran``: the failed attempt's nodes by the names it ran under (`plan_nodes`);
    the new plan names the nodes it keeps by those names. Writes
    ``RUN/recover/plan-<attempt>.yaml`` when ``write`` (``plan_path`` names it either way).
    Raises MscaleError when no layout fits any of the remaining nodes."""
    nodes = plan_nodes(plan, ran)
    out = set(exclusions.kept_out)
    remaining = [n for n in nodes if n not in out]
    if len(remaining) == len(nodes):
        return None
    batch = plan.training.global_batch
    if not remaining:
        raise MscaleError(f"every node of the plan is excluded ({collect_hostlist(nodes)})",
                          file=run.plan, field="cluster.hostlist",
                          fix="clear quarantine.json entries that no longer hold (or the job's "
                              "own --exclude of nodes it may use again), or give the run other "
                              "nodes, then run recover again")
    fit = find_fit(plan, remaining, allow_batch_change)
    if fit is None:
        raise MscaleError(f"no layout runs global batch {batch} on any of the remaining "
                          f"{len(remaining)} node(s) ({collect_hostlist(remaining)})",
                          file=run.plan, field="training.global_batch",
                          fix="allow a batch change (--allow-batch-change) or give the run more "
                              "nodes")
    new = accepted(plan, fit, run.plan)
    path = f"{run.recover}/plan-{next_attempt(run.root):04d}.yaml"
    if write:
        write_text_atomic(path, dump_yaml(new))
        load_checked_plan(path)  # what was written reads back as it was checked
    old_t = _step_time(Problem(plan.model, plan.training, plan.cluster), plan.layout)
    return Replan(plan_path=path, nodes=list(fit.nodes), world=fit.problem.cluster.world_size,
                  layout=describe_layout(new), old_layout=describe_layout(plan),
                  old_step_time_s=old_t, new_step_time_s=fit.cost.step_time,
                  global_batch=new.training.global_batch, batch_changed=fit.batch_changed,
                  unused_nodes=list(fit.unused), note=_note(plan, fit, old_t, len(nodes)))


def find_fit(plan: Plan, remaining: list[str], allow_batch_change: bool) -> Fit | None:
    """The first layout in the module docstring's order of preference."""
    budget = [MAX_SEARCHES]
    batch = plan.training.global_batch
    fit = fit_nodes(plan, remaining, batch, budget)
    if fit is not None:
        return fit
    if allow_batch_change:
        for b in nearest_batches(batch, len(remaining) * plan.cluster.gpus_per_node,
                                 plan.training.micro_batch or 1):
            fit = fit_nodes(plan, remaining, b, budget)
            if fit is not None:
                fit.batch_changed = True
                fit.how += f"; global batch {batch} -> {b} (allowed)"
                return fit
    return best_subset(plan, remaining, budget)


def best_subset(plan: Plan, remaining: list[str], budget: list[int]) -> Fit | None:
    """The largest subset of ``remaining`` (its first k nodes) that runs the global batch,
    unless a smaller one is predicted faster: with the batch fixed, a shorter step is more
    throughput on fewer nodes, strictly better. Node counts are scanned from the top; each is
    tried by keeping tp/pp/vpp (cheap) and by the search while the budget lasts."""
    batch, best = plan.training.global_batch, None
    for k in range(len(remaining) - 1, 0, -1):
        fit = fit_nodes(plan, remaining[:k], batch, budget)
        if fit is not None and (best is None or fit.cost.step_time < best.cost.step_time):
            fit.unused = remaining[k:]
            best = fit
    return best


def nearest_batches(batch: int, world: int, micro_batch: int) -> list[int]:
    """Global batches near ``batch`` that some data-parallel size on ``world`` ranks divides:
    multiples of dp·micro_batch just below and above it, nearest first."""
    found = set()
    for dp in divisors(world):
        q = dp * micro_batch
        found.update(b for b in ((batch // q) * q, -(-batch // q) * q) if b > 0 and b != batch)
    return sorted(found, key=lambda b: (abs(b - batch), b))[:BATCH_CANDIDATES]


def narrow(plan: Plan, nodes: list[str], batch: int) -> Problem:
    """The planning problem on ``nodes`` only (hostlist and count), with global batch ``batch``."""
    hostlist = collect_hostlist(nodes)
    if expand_hostlist(hostlist) != nodes:  # a hostlist in its own order: keep that order
        hostlist = ",".join(nodes)
    data = plan.cluster.model_dump(mode="json", exclude_none=True)
    cluster = ClusterConfig.model_validate({**data, "nodes": len(nodes), "hostlist": hostlist})
    training = TrainingConfig.model_validate(
        {**plan.training.model_dump(mode="json", exclude_none=True), "global_batch": batch})
    return Problem(plan.model, training, cluster)


def fit_nodes(plan: Plan, nodes: list[str], batch: int, budget: list[int]) -> Fit | None:
    """Rule 1 (keep tp/pp/vpp), else rule 2 (search, while ``budget`` lasts) on ``nodes``."""
    world, lay = len(nodes) * plan.cluster.gpus_per_node, plan.layout
    shape_ok = world % (lay.tp * lay.pp) == 0 and batch % (world // (lay.tp * lay.pp)
                                                           * lay.micro_batch) == 0
    if not shape_ok and budget[0] <= 0:
        return None  # arithmetic only: nothing to try here without a search
    pb = narrow(plan, nodes, batch)
    kept = keep_shape(plan.layout, pb) if shape_ok else None
    if kept is not None:
        lay, cost = kept
        m0, m1 = plan.layout.micro_batches(plan.training.global_batch), cost.micro_batches
        return Fit(nodes, lay, cost, pb, f"kept tp{lay.tp} pp{lay.pp}"
                   + (f" vpp{lay.vpp}" if lay.vpp > 1 else "")
                   + f", dp {plan.layout.dp} -> {lay.dp}, {m0} -> {m1} micro-batches per step")
    if budget[0] <= 0 or not skeletons(pb, Rejects()):  # arithmetic first: no layout at all
        return None
    budget[0] -= 1
    res = search(pb)
    if not res.count:
        return None
    lay = res.layout(0)
    return Fit(nodes, lay, res.cost(0), pb, "planner search (tp/pp/vpp could not stay)")


def keep_shape(old: LayoutConfig, pb: Problem) -> tuple[LayoutConfig, LayoutCost] | None:
    """``old`` with only dp changed to fill ``pb``'s world, if it is valid and fits in memory."""
    world = pb.cluster.world_size
    if world % (old.tp * old.pp):
        return None
    lay = old.model_copy(update={"dp": world // (old.tp * old.pp)})
    try:
        check_layout(lay, pb.model, pb.training, pb.cluster)
        Placement(lay.tp, lay.pp, lay.dp, pb.cluster.gpus_per_node)
    except MscaleError:
        return None
    cost = evaluate(pb, lay)
    return (lay, cost) if cost.fits else None


def build_plan(old: Plan, fit: Fit) -> Plan:
    """The new plan: the planner's plan file for ``fit``, with the old plan's checkpoint advice
    (none when it had none): train saves at the advice's interval when nothing else sets one,
    so new advice would change the run's save cadence."""
    new = make_plan(fit.problem, fit.layout, fit.cost, old.name)
    new.checkpoint = old.checkpoint
    return new


def accepted(old: Plan, fit: Fit, source: str) -> Plan:
    """The plan for ``fit``, loaded back as train loads it (`load_checked_plan`, from a scratch
    file) and checked against the run's plan ``old`` (`check_plan_change`, a new global batch
    accepted when the fit changed it, as train accepts it under --allow-batch-change, which the
    relaunch passes); raises MscaleError when train would refuse it."""
    text = dump_yaml(build_plan(old, fit))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = f"{tmp}/plan.yaml"
        write_text_atomic(scratch, text)
        loaded = load_checked_plan(scratch)
    check_plan_change(old, loaded, source=source, allow_batch_change=fit.batch_changed)
    return loaded


def _step_time(pb: Problem, layout: LayoutConfig) -> float | None:
    try:
        return evaluate(pb, layout).step_time
    except (MscaleError, ValueError, ZeroDivisionError):
        return None


def _note(old: Plan, fit: Fit, old_t: float | None, old_nodes: int) -> str:
    """What the change costs, in one sentence."""
    used = f"on {len(fit.nodes)} of {old_nodes} nodes"
    if fit.unused:
        used += f" ({len(fit.unused)} healthy node(s) idle: no layout uses them with global " \
                f"batch {old.training.global_batch})"
    new_t = fit.cost.step_time
    if old_t:
        pct = 100.0 * (new_t - old_t) / old_t
        t = f"predicted step time {old_t:.4g} s -> {new_t:.4g} s ({pct:+.0f}%)"
    else:
        t = f"predicted step time {new_t:.4g} s"
    if old.cluster.gpu.is_cpu:  # the planner's rates are GPUs': mscale plan says the same
        t += " (on CPUs not a prediction: gloo latency and shared cores dominate; docs/plan.md)"
    return f"{t} {used}; {fit.how}"
