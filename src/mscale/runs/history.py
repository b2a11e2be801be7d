"""A run directory belongs to one model and one training recipe; its layout may change.

Resuming a checkpoint only makes sense for the model and recipe that wrote it, while a new layout
or a smaller cluster of the same model is exactly what ``recover`` does after excluding nodes (the
checkpoint reshards on load). `check_plan_change` tells the two apart:

- refused (`MscaleError`, exit 3): any field of ``model`` except its free-form ``name`` (so
  ``seq_len`` too), and the training settings that define what the weights and the optimizer state
  mean: ``global_batch``, ``seed``, ``optimizer`` and the data source ``data`` (kind, path,
  dtype; a moved token file can keep its old path through a link). ``global_batch`` may change
  when the caller allows it (``train --allow-batch-change``, which `mscale recover` passes when
  too few nodes remain for the old batch): the data then continues from the samples the
  checkpoint has consumed (`ckpt.manifest.TrainState.samples`), not from step · new batch. So may
  ``data`` (``train --allow-data-change``: a curriculum step, new blend weights or sources): the
  run continues at the same global sample of the new mixture (docs/data.md).
- accepted and described: the layout, the cluster, the placement, the plan's name and every other
  training setting (steps, learning-rate schedule, clipping, precision, buckets, checkpoint
  interval, ...), which runs legitimately change on a restart.
- ignored: ``estimate`` and ``checkpoint`` (the planner's advice, derived from the rest) and
  ``schema_version`` fields.

`plan_change_of` judges a plan against ``RUN/plan.yaml`` and writes nothing (a refused plan
writes nothing); `write_plan` keeps ``RUN/plan.yaml`` as the plan the run trains with now and
``RUN/plans/`` as every plan it has trained with (``plan-0001.yaml``, ...): a plan.yaml is never
replaced before it is in the history. ``train`` calls both (`train.session.RunSession.claim`),
writing a change at its claim or once a step will train. A plan.yaml no step has trained with
(`has_trained`) refuses nothing: a first start that failed before step 1 does not pin its plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from mscale.config.base import dump_yaml, load_model
from mscale.config.plan import Plan
from mscale.errors import MscaleError
from mscale.runs.atomic import SEGMENTS, fs_and_path, write_text_atomic
from mscale.runs.rundir import RunDir
from mscale.urls import location_key

IDENTITY = ("model.", "training.global_batch", "training.seed", "training.optimizer",
            "training.data.")
"""Dotted field prefixes that a run directory's plan may never change (global_batch: unless
allowed)."""
BATCH = "training.global_batch"
DATA = "training.data."
_FREE = ("model.name", "training.data.read_ahead", "training.data.remote_retry_s")
"""Fields under an identity prefix that say how, not what: how far ahead and how patiently the
data is read changes no sample (and a run directory's plan from before such a field had none)."""
_IGNORED_TOP = ("estimate", "checkpoint")
_RELAYOUT = ("layout.", "cluster.", "placement.")
_HISTORY_NAME = re.compile(r"^plan-(\d+)\.yaml$")


@dataclass(frozen=True)
class PlanChange:
    """What a new plan changes in a run directory."""

    kind: Literal["new", "same", "changed"]
    """``new``: no plan before; ``same``: nothing that matters differs; ``changed``: accepted."""
    fields: tuple[str, ...] = ()
    """Dotted names of the fields that differ (all accepted ones)."""
    old_layout: str | None = None
    """The previous layout in words, e.g. ``tp2 pp2 dp2 on 4 nodes (cpu-4x2)``."""
    new_layout: str | None = None
    """The new layout in words."""
    untrained: bool = False
    """The run's plan trained no step (a start before this one failed before step 1, or had
    nothing to train): nothing of the run means anything for it, so this plan replaces it
    whatever it changes, model and recipe included (`has_trained`)."""
    history: str | None = None
    """The ``plans/plan-NNNN.yaml`` that `write_plan` wrote for the new plan; None while it is
    not written (`plan_change_of` writes nothing; ``train`` writes another layout at its claim,
    any other change once a step will train, and records the change then)."""

    @property
    def relayout(self) -> bool:
        """True when the layout, cluster or placement changed (what recover does)."""
        return any(f.startswith(_RELAYOUT) for f in self.fields)

    def message(self) -> str:
        """One line for the console and the start event."""
        if self.kind == "new":
            return f"new run directory: {self.new_layout}"
        if self.kind == "same":
            return f"same plan as before: {self.new_layout}"
        head = (f"layout {self.old_layout} -> {self.new_layout}" if self.relayout
                else f"layout unchanged ({self.new_layout})")
        others = [f for f in self.fields if not f.startswith(_RELAYOUT)]
        return head + (f"; also changed: {', '.join(others)}" if others else "")

    def evidence(self) -> dict[str, Any]:
        """The change as JSON-able fields for an event's ``evidence``."""
        return {"plan_change": self.kind, "fields": list(self.fields),
                "old_layout": self.old_layout, "new_layout": self.new_layout,
                "plan_history": self.history}


def describe_layout(plan: Plan) -> str:
    """A layout and its cluster in a few words."""
    lay, cl = plan.layout, plan.cluster
    vpp = f" vpp{lay.vpp}" if lay.vpp > 1 else ""
    nodes = f"{cl.num_nodes} node" + ("s" if cl.num_nodes != 1 else "")
    return f"tp{lay.tp} pp{lay.pp} dp{lay.dp}{vpp} on {nodes} ({cl.name})"


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key != "schema_version":
            out.update(_flatten(value, f"{prefix}{key}."))
    return out


def _comparable(plan: Plan, placement: bool, located: bool = True) -> dict[str, Any]:
    """The plan's fields to compare, flattened; ``training.data`` as `same_spelling` gives it
    (``located``: sources by location, for the comparison; else as written, for the words)."""
    exclude = set(_IGNORED_TOP) | (set() if placement else {"placement"})
    dumped = plan.model_dump(mode="json", exclude=exclude)
    dumped["training"]["data"] = same_spelling(dumped["training"]["data"], located)
    return _flatten(dumped)


def same_spelling(data: dict, located: bool = True) -> dict:
    """A dumped ``training.data`` with (``located``) each source, ``path`` or an entry of
    ``sources``/``eval_sources``, named by its location (`location_key`): ``./data/x``,
    ``data/x/``, its absolute path or ``file://`` URL and a symlink to it are one local source;
    a URL is one but for a trailing slash. A spelling changes no sample: compared as written, a
    resume spelling a source another way was refused as a changed recipe. Another location
    stays another."""
    if not located:
        return data
    out = dict(data)
    if isinstance(out.get("path"), str):
        out["path"] = location_key(out["path"])
    for key in ("sources", "eval_sources"):
        if isinstance(out.get(key), list):
            out[key] = [{**s, "path": location_key(s["path"])} if isinstance(s, dict)
                        and isinstance(s.get("path"), str) else s for s in out[key]]
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_SOURCE_LISTS = ("training.data.sources", "training.data.eval_sources")


def _describe(key: str, old: Any, new: Any) -> str:
    """One refused field's change: a blend's sources by what differs (a source added or removed,
    a weight from what to what), any other field as old -> new (shortened)."""
    if key in _SOURCE_LISTS and isinstance(old or [], list) and isinstance(new or [], list):
        return f"{key}: {describe_sources(old or [], new or [])}"
    return f"{key}: {_short(old)} -> {_short(new)}"


def describe_sources(old: list[dict], new: list[dict]) -> str:
    """What differs between two lists of ``{path, weight}`` (a blend's sources), in words."""
    def weights(sources):
        return {s.get("path"): s.get("weight", 1.0) for s in sources}
    a, b = weights(old), weights(new)
    parts = [f"{p} weight {a[p]:g} -> {b[p]:g}" for p in a if p in b and a[p] != b[p]]
    parts += [f"{p} added (weight {b[p]:g})" for p in b if p not in a]
    parts += [f"{p} removed (weight {a[p]:g})" for p in a if p not in b]
    if not parts and list(a) != list(b):
        parts = [f"order {', '.join(map(str, a))} -> {', '.join(map(str, b))}"]
    return "; ".join(parts) or f"{_short(old)} -> {_short(new)}"


def check_plan_change(old: Plan, new: Plan, source: str | None = None, *,
                      allow_batch_change: bool = False,
                      allow_data_change: bool = False) -> PlanChange:
    """Compare the run directory's plan ``old`` with ``new`` (module docstring for which fields
    refuse); raise MscaleError naming the refused fields, else describe the change.

    ``source`` names the old plan's file in the error. Placements are compared only when both
    plans carry one; without one a plan's placement follows from its layout, which is compared.
    ``allow_batch_change`` accepts a new ``training.global_batch``, ``allow_data_change`` a new
    ``training.data``.
    """
    placement, differ = _differences(old, new)
    a, b = _comparable(old, placement), _comparable(new, placement)
    free = _FREE + ((BATCH,) if allow_batch_change else ())
    refused = [k for k in differ if k.startswith(IDENTITY) and k not in free
               and not (allow_data_change and k.startswith(DATA))]
    if refused == [BATCH]:
        raise MscaleError(
            f"the plan changes the run's global batch ({_short(a.get(BATCH))} -> "
            f"{_short(b.get(BATCH))})", file=source, field=BATCH,
            fix="keep the run's global batch, or pass --allow-batch-change to continue the data "
                "from the samples already consumed with the new batch")
    if refused:
        a, b = _comparable(old, placement, False), _comparable(new, placement, False)
        shown = "; ".join(_describe(k, a.get(k), b.get(k)) for k in refused[:3])
        more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
        raise MscaleError(
            f"this run directory belongs to another model or training recipe ({shown}{more}); "
            "its checkpoints would be meaningless for the new plan", file=source, field=refused[0],
            fix="use a new --run-dir for a new model or recipe, or keep the run's plan (its "
                "layout, cluster and schedule may change)"
                + ("; a change of training.data on purpose (new blend weights or sources): "
                   "--allow-data-change" if all(k.startswith(DATA) for k in refused) else ""))
    return PlanChange(kind="changed" if differ else "same", fields=tuple(differ),
                      old_layout=describe_layout(old), new_layout=describe_layout(new))


def _differences(old: Plan, new: Plan) -> tuple[bool, list[str]]:
    """Whether placements are compared, and the dotted fields that differ (sorted)."""
    placement = old.placement is not None and new.placement is not None
    a, b = _comparable(old, placement), _comparable(new, placement)
    return placement, sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def has_trained(run: RunDir) -> bool:
    """Whether any step was trained in the run directory: rank 0 appends a ``metrics.jsonl``
    record for every step (on an object store a ``metrics.jsonl.d/`` segment), and a checkpoint
    (anything under ``ckpt/`` but a hidden entry: a storage probe ``mscale preflight`` was
    killed in leaves ``ckpt/.preflight-*``) follows a step. Unreadable counts as trained: the
    refusal of another model or recipe is what protects a run. ``ckpt/`` is listed before the
    segments: on an object store a long run's segments are the longer listing."""
    try:
        fs, metrics = fs_and_path(run.metrics)
        if fs.isfile(metrics) and fs.size(metrics) > 0:
            return True
        cfs, ckpt = fs_and_path(run.ckpt)
        if cfs.isdir(ckpt) and any(not p.rstrip("/").rsplit("/", 1)[-1].startswith(".")
                                   for p in cfs.ls(ckpt, detail=False)):
            return True
        segments = metrics + SEGMENTS
        return fs.isdir(segments) and bool(fs.ls(segments, detail=False))
    except OSError:
        return True


def plan_history(run: RunDir) -> list[str]:
    """URLs of the run's recorded plans, oldest first."""
    fs, root = fs_and_path(run.plans)
    if not fs.isdir(root):
        return []
    found = [(int(m.group(1)), p.rsplit("/", 1)[-1]) for p in fs.ls(root, detail=False)
             if (m := _HISTORY_NAME.match(p.rsplit("/", 1)[-1]))]
    return [f"{run.plans}/{name}" for _, name in sorted(found)]


def plan_change_of(run: RunDir, plan: Plan, *, allow_batch_change: bool = False,
                   allow_data_change: bool = False) -> PlanChange:
    """How ``plan`` differs from ``RUN/plan.yaml`` (``new`` when there is none), raising if it
    is refused (`check_plan_change`); writes nothing. ``train`` checks at its start and writes
    a changed plan only once the start goes ahead: a start that fails or has nothing to train
    leaves the run's plan as it was. A plan.yaml no step has trained with (`has_trained`: the
    first start wrote it and failed before step 1, on a model that did not fit or a data path
    found wrong) refuses nothing: the fixed plan is `PlanChange.untrained`, not "another model
    for this run directory"."""
    fs, path = fs_and_path(run.plan)
    if not fs.isfile(path):
        return PlanChange(kind="new", new_layout=describe_layout(plan))
    old = load_model(Plan, run.plan)
    if not has_trained(run):
        differ = _differences(old, plan)[1]
        return PlanChange(kind="changed" if differ else "same", fields=tuple(differ),
                          old_layout=describe_layout(old), new_layout=describe_layout(plan),
                          untrained=True)
    return check_plan_change(old, plan, source=run.plan,
                             allow_batch_change=allow_batch_change,
                             allow_data_change=allow_data_change)


def write_plan(run: RunDir, plan: Plan, change: PlanChange) -> PlanChange:
    """Add ``plan`` to ``RUN/plans/`` and write ``RUN/plan.yaml`` atomically; returns ``change``
    with the history entry. The previous plan.yaml is in the history before it is replaced (a
    run directory from before the history existed gets its plan.yaml archived as the first
    entry)."""
    fs, path = fs_and_path(run.plan)
    history = plan_history(run)
    if fs.isfile(path) and not history:
        history = [_add_history(run, [], fs.cat_file(path).decode())]
    text = dump_yaml(plan)
    entry = _add_history(run, history, text)
    write_text_atomic(run.plan, text)
    return replace(change, history=entry)


def _add_history(run: RunDir, history: list[str], text: str) -> str:
    """Write ``text`` as the next plans/plan-NNNN.yaml, unless the last entry already holds it
    (a crash between the history and plan.yaml); return the entry's URL."""
    if history:
        fs, last = fs_and_path(history[-1])
        if fs.cat_file(last).decode() == text:
            return history[-1]
        n = int(_HISTORY_NAME.match(history[-1].rsplit("/", 1)[-1]).group(1)) + 1
    else:
        n = 1
    url = f"{run.plans}/plan-{n:04d}.yaml"
    write_text_atomic(url, text)
    return url
