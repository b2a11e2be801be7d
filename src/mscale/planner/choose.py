"""What ``mscale plan`` decides between reading its files and writing the plan: the parts it is
given (refusing a whole plan passed as one), the problem it prices (with ``--calibrate``'s
measured rates), the given layout evaluated next to the search's best, and which of the two
becomes the plan.

A module of its own because it needs the cost model, the search, the given layout and the
calibration together, all of which sit below it (calibrate.py cannot price a layout: cost.py
imports it); the CLI (cli/plan.py) only parses, calls this and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig
from mscale.config.base import parse_yaml, validate
from mscale.config.files import read_text
from mscale.config.layout import LayoutConfig
from mscale.config.plan import PLAN_SECTIONS, check_part_fields, first_keys, part_of
from mscale.errors import MscaleError
from mscale.planner.advice import device_word, no_fit_error
from mscale.planner.calibrate import (Calibration, check_matches, check_world, fit_speed,
                                      load_calibration)
from mscale.planner.cost import LayoutCost, Problem, evaluate
from mscale.planner.given import given_layout, load_layout_data
from mscale.planner.search import SearchResult, describe, search


Configs = tuple[ModelConfig, TrainingConfig, ClusterConfig]
"""The three parts of a problem, in `Problem`'s order."""


def load_part(schema, path: str, option: str):
    """Load the cluster, model or training file given as ``option``. A whole plan given instead
    would otherwise fail on its first missing field ("layers: required field is missing"),
    which does not say what is wrong; the file is read once (it may be a pipe)."""
    data = parse_yaml(read_text(path), str(path))
    found = [k for k in PLAN_SECTIONS if isinstance(data, dict) and k in data]
    if found:
        what = option.removeprefix("--")
        raise MscaleError(
            f"this looks like a whole plan (it has {', '.join(k + ':' for k in found)}), "
            f"not a {what} file", file=str(path), field=option,
            fix=f"give its parts as separate files (--cluster plans/clusters/X.yaml --model "
                f"plans/models/X.yaml --training plans/training/X.yaml) and the plan itself as "
                f"--layout {path} to price its layout next to the best")
    other = part_of(data)
    what = option.removeprefix("--")
    if other not in (None, what) and not set(data) <= set(schema.model_fields):
        raise MscaleError(f"this looks like a {other} file (it has {first_keys(data)}), not a "
                          f"{what} file",
                          file=str(path), field=option,
                          fix=f"give it as --{other}, and a {what} file as {option}")
    check_part_fields(schema, data, option, str(path))
    return validate(schema, data, str(path))


def load_parts(model: str, training: str, cluster: str) -> Configs:
    """The model, training and cluster files of ``--model``, ``--training``, ``--cluster``."""
    return (load_part(ModelConfig, model, "--model"),
            load_part(TrainingConfig, training, "--training"),
            load_part(ClusterConfig, cluster, "--cluster"))


def calibration_for(configs: Configs, stack: str | None, paths: list[str],
                    given: LayoutConfig | None, layout_path: str | None = None) -> Calibration:
    """Measured rates from the files; a run's step time needs the layout it ran (``given``,
    from ``layout_path`` or the options), whose predicted step time is fitted to it."""
    cal = load_calibration(paths)
    check_matches(cal, configs[2].gpu.name)
    if cal.step_time_s is not None:
        if given is None:
            raise MscaleError("a metrics.jsonl calibrates against the layout that run used",
                              field="--calibrate", fix="give that layout too: --layout "
                              "RUN/plan.yaml (or --tp/--pp/...)")
        ran = load_layout_data(layout_path).get("dp") if layout_path else None
        if ran is not None and ran != given.dp:  # given_layout re-derived it for this cluster
            raise MscaleError(f"the run ran at dp={ran}, this cluster's layout has dp={given.dp}:"
                              " its step time measures another batch split", file=layout_path,
                              field="layout.dp", fix="calibrate with --cluster the run used")
        check_world(cal, given.tp * given.pp * given.dp)
        fit_speed(cal, lambda c: evaluate(Problem(*configs, stack=stack, calibration=c),
                                          given).step_time)
    return cal


@dataclass
class Choice:
    """The search, the given layout with its cost, and the layout that becomes the plan."""

    problem: Problem
    result: SearchResult
    given: tuple[LayoutConfig, LayoutCost] | None
    """The layout the user gave (``--layout``, ``--tp``...) and its cost, or None."""
    layout: LayoutConfig
    cost: LayoutCost


def choose(configs: Configs, *, stack: str | None = None, options: dict[str, Any] | None = None,
           layout_path: str | None = None, calibrate: list[str] | None = None,
           keep_given: bool = False, files: dict[str, str] | None = None) -> Choice:
    """Search every layout and choose the plan's: the best that fits; the given one with
    ``keep_given``, or when it fits and nothing the search tried does. ``options`` are the given
    layout's fields (None: unset), ``files`` the paths a no-fit error names. An unknown
    ``stack``, a bad given layout and ``keep_given`` without one are refused before the search;
    a given layout that does not fit, or nothing that fits, is an MscaleError with the fix."""
    pb = Problem(*configs, stack=stack)
    try:
        pb.stack_profile  # an unknown stack is refused before any work
    except MscaleError as e:
        if stack is not None:  # the option's, not the training file's
            e.field, e.file = "--stack", None
        raise
    given_lo = given_layout(pb, options or {}, layout_path)
    if calibrate:
        pb = Problem(*configs, stack=stack,
                     calibration=calibration_for(configs, stack, calibrate, given_lo,
                                                 layout_path))
    if keep_given and given_lo is None:
        raise MscaleError("--keep-given needs a given layout", field="--keep-given",
                          fix="add --layout FILE or --tp/--pp/... options")
    given = (given_lo, evaluate(pb, given_lo)) if given_lo else None
    result = search(pb)
    files = files or {}
    if keep_given or (result.count == 0 and given is not None and given[1].fits):
        layout, cost = given
        if not cost.fits:
            if result.count == 0:
                raise no_fit_error(pb, result, files)
            raise MscaleError(f"the given layout needs {cost.mem_total / 1e9:.1f} GB per "
                              f"{device_word(pb)}, "
                              f"more than {pb.budget_bytes / 1e9:.1f} GB usable",
                              file=layout_path or "command line", field="layout",
                              fix=f"the best layout that fits is {describe(result.layout(0))}")
    elif result.count == 0:
        raise no_fit_error(pb, result, files)
    else:
        layout, cost = result.layout(0), result.cost(0)
    return Choice(problem=pb, result=result, given=given, layout=layout, cost=cost)
