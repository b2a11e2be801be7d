"""The resolved plan (``plan.yaml``): everything `preflight` and `train` need, in one file.

`mscale plan` writes it; `train` re-derives the placement from the layout with the same function
and refuses a plan whose rank map disagrees, so a hand-edited map cannot silently mis-wire groups.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mscale.config.base import StrictModel, parse_yaml, validate
from mscale.config.cluster import ClusterConfig
from mscale.config.files import read_text
from mscale.config.layout import LayoutConfig, check_layout
from mscale.config.model import ModelConfig
from mscale.config.training import TrainingConfig
from mscale.errors import MscaleError

PLAN_SCHEMA_VERSION = 1


class GroupsRecord(StrictModel):
    """Process groups as lists of global ranks; each list partitions the world."""

    tp: list[list[int]]
    """Tensor-parallel groups (inside a node)."""
    pp: list[list[int]]
    """Pipeline groups, stage 0 first."""
    dp: list[list[int]]
    """Data-parallel groups."""


class PlacementRecord(StrictModel):
    """Where every rank runs and what it does."""

    order: Literal["tp-dp-pp"] = "tp-dp-pp"
    """Rank order, fastest-varying first: TP neighbours share a node, DP groups are contiguous
    (so they stay in a pod), pipeline stages are farthest apart."""
    columns: list[str] = ["rank", "node", "local_rank", "dp", "pp", "tp"]
    """Meaning of each entry of ``ranks``."""
    ranks: list[list[int]]
    """One row per global rank, laid out as ``columns``."""
    nodes: list[str]
    """Node names; ``node`` in a rank row indexes this list."""
    groups: GroupsRecord
    """The process groups built from this placement."""


class CheckpointAdvice(StrictModel):
    """The goodput model's recommendation (Young/Daly)."""

    interval_steps: int = Field(gt=0)
    """Steps between checkpoints that minimise expected lost time."""
    interval_s: float = Field(ge=0)
    """The same interval in seconds of training."""
    mtbf_h: float = Field(gt=0)
    """Expected hours between failures for the whole job."""
    checkpoint_cost_s: float = Field(ge=0)
    """Blocking time of one checkpoint, as estimated."""
    restart_s: float = Field(ge=0)
    """Time from a failure to training again (detect, relaunch, load)."""
    effective_training: float = Field(ge=0, le=1)
    """Expected share of wall time spent making progress (goodput), 0..1."""


PLAN_NAME_MAX = 200
"""Longest plan name (`mscale plan --name`)."""


class Plan(StrictModel):
    """A complete, runnable plan."""

    schema_version: int = Field(default=PLAN_SCHEMA_VERSION, ge=1, le=PLAN_SCHEMA_VERSION)
    """Version of the plan schema."""
    name: str = Field(default="plan", max_length=PLAN_NAME_MAX)
    """Run name."""
    cluster: ClusterConfig
    """The cluster the plan was made for."""
    model: ModelConfig
    """The model."""
    training: TrainingConfig
    """Training settings."""
    layout: LayoutConfig
    """The chosen layout."""
    placement: PlacementRecord | None = None
    """Rank map and groups. Filled in by `mscale plan`; derived from ``layout`` when absent."""
    estimate: dict[str, Any] = {}
    """The cost model's breakdown for this layout (memory, time, MFU); informational."""
    checkpoint: CheckpointAdvice | None = None
    """Checkpoint-interval recommendation."""


def load_plan(path: str, check: bool = True) -> Plan:
    """Load a plan file and check its layout against its model and cluster.

    The ``placement:`` section is only parsed here: checking it means re-deriving the rank map,
    which is topology's job, a layer above this one. Whoever runs or reshards a plan loads it
    with `mscale.topology.placement.load_checked_plan`, which checks both.
    """
    data = parse_yaml(read_text(path), str(path))  # read once: it may be a pipe
    _refuse_a_part(data, str(path))
    plan = validate(Plan, data, str(path))
    if check:
        check_layout(plan.layout, plan.model, plan.training, plan.cluster, source=path)
    return plan


LAYOUT_CHOICES = ("micro_batch", "zero_stage", "recompute")
"""Fields of both ``training`` and ``layout``: in a training file they narrow `mscale plan`'s
search; in a plan the layout's value is what trains."""


def check_training_matches_layout(plan: Plan, source: str) -> None:
    """Refuse a plan whose training section asks for another micro-batch, ZeRO stage or
    recompute than its layout trains with. The layout's value wins, so a plan edited in its
    ``training:`` section (where a training file sets them) trained as before, silently."""
    for name in LAYOUT_CHOICES:
        wanted, trained = getattr(plan.training, name), getattr(plan.layout, name)
        if wanted is not None and wanted != trained:
            raise MscaleError(
                f"{wanted} but layout.{name} is {trained}: a plan trains with its layout's "
                f"{name}; training.{name} only narrows `mscale plan`'s search",
                file=source, field=f"training.{name}",
                fix=f"to train with {wanted}, set layout.{name}: {wanted} too (or make the plan "
                    f"again with `mscale plan`); to keep {trained}, set training.{name}: "
                    f"{trained} or remove it")


PARTS = {"model": ModelConfig, "training": TrainingConfig, "cluster": ClusterConfig}
"""The files `mscale plan` makes a plan from, by option name."""
PLAN_SECTIONS = ("cluster", "model", "training", "layout")
"""Top-level keys of a plan file; none is a field of a cluster, model or training file, so
finding one means a whole plan was given where one part was expected, and none a part where a
plan was."""


def _refuse_a_part(data: Any, source: str) -> None:
    """A model, training or cluster file given where a plan belongs failed on a pile of missing
    sections ("cluster: required field is missing; also model: ...") that does not say what is
    wrong: it is named as the part it is, with the command that makes a plan of it."""
    if not isinstance(data, dict) or not data or any(k in data for k in PLAN_SECTIONS):
        return
    option = part_of(data)
    if option is not None:
        raise MscaleError(
            f"this looks like a {option} file (it has {first_keys(data)}), not a plan",
            file=source,
            fix=f"make a plan of it first: mscale plan --cluster CLUSTER.yaml --model "
                f"MODEL.yaml --training TRAINING.yaml -o plan.yaml (this file as --{option}; "
                f"docs/plan.md), then give plan.yaml")


def first_keys(data: dict) -> str:
    """``layers:, hidden:, heads:``: what a misplaced file's own keys say it is (``name`` is
    every part's, and says nothing)."""
    return ", ".join(f"{k}:" for k in [k for k in data if k != "name"][:3])


def part_of(data: Any) -> str | None:
    """Which of `PARTS` a file's keys all belong to (``model``, ...), None if none: what a file
    given in the wrong place really is."""
    if not isinstance(data, dict) or not data:
        return None
    return next((option for option, schema in PARTS.items()
                 if set(data) <= set(schema.model_fields)), None)


LAYOUT_FLAGS = {"tp": "--tp", "pp": "--pp", "vpp": "--vpp", "micro_batch": "--micro-batch",
                "sequence_parallel": "--sp", "recompute": "--recompute", "zero_stage": "--zero",
                "dp_reduce": "--dp-reduce"}
"""`mscale plan`'s option for each layout field it takes from the command line (``dp`` follows
from the cluster, ``stage_layers`` from a layout file)."""


def check_part_fields(schema: type, data: Any, option: str, source: str) -> None:
    """A field of the layout, or of another part, written in a ``--cluster``, ``--model`` or
    ``--training`` file said "unknown field (a typo?)", fix "correct the field", though it is
    spelt right: the error names where it goes instead (``tp`` is a layout choice: --tp)."""
    if not isinstance(data, dict):
        return
    what = option.removeprefix("--")
    for key in (k for k in data if isinstance(k, str) and k not in schema.model_fields):
        if key in LayoutConfig.model_fields:
            how = f"give it to plan as {LAYOUT_FLAGS[key]}, or" if key in LAYOUT_FLAGS else \
                ("plan derives it from the cluster's GPUs and tp·pp; give a whole layout in "
                 "a layout file (plan --layout FILE) or" if key == "dp" else
                 "give it in a layout file (plan --layout FILE) or")
            raise MscaleError(f"not a field of a {what} file: {key} is a layout choice",
                              file=source, field=key,
                              fix=f"{how} in a plan's layout section (layout.{key})")
        home = next((o for o, s in PARTS.items() if o != what and key in s.model_fields), None)
        if home is not None:
            raise MscaleError(f"not a field of a {what} file: it belongs in the {home} file",
                              file=source, field=key,
                              fix=f"move it to the file given as --{home} ({home}.{key} in a "
                                  "plan)")
