"""The ranked rows `mscale plan` shows: layouts the model prices the same fold into one row."""

import functools

import numpy as np
import pytest

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig
from mscale.config.base import load_model
from mscale.planner.cost import Problem
from mscale.planner.report import EQUAL_COST_RTOL, distinct, json_document
from mscale.planner.search import search

from tests.conftest import PLANS


def problem(model: str, training: str, cluster: str, stack: str | None = None) -> Problem:
    return Problem(load_model(ModelConfig, PLANS / "models" / f"{model}.yaml"),
                   load_model(TrainingConfig, PLANS / "training" / f"{training}.yaml"),
                   load_model(ClusterConfig, PLANS / "clusters" / f"{cluster}.yaml"), stack=stack)


@functools.lru_cache(maxsize=None)
def gpt175(stack: str | None = None):
    """175B on 12,288 A100s: the search ranks ZeRO 1/2 and even/light-ends twins side by side."""
    return search(problem("gpt-175b", "gpt-175b", "a100-12288", stack))


def key(c) -> tuple[float, float]:
    return c.step_time, c.mem_total


@pytest.mark.parametrize("stack", [None, "megascale"])
def test_top_rows_are_distinct_costs(stack):
    result = gpt175(stack)
    raw = [key(result.cost(i)) for i in range(5)]
    assert len(set(raw)) < 5  # what --top 5 showed before: the same figures on several rows
    rows = distinct(result, 5)
    assert len(rows) == 5 and len({key(r.cost) for r in rows}) == 5
    assert [r.label for r in rows] == ["1", "2", "3", "4", "5"]


def test_each_row_holds_every_layout_of_its_cost_and_no_other():
    result = gpt175()
    costs = {key(result.cost(i)) for i in range(result.count)}
    assert len(costs) < result.count
    every = [(key(result.cost(i)), result.layout(i)) for i in range(result.count)]
    for r in distinct(result, 5):
        same = [lo for k, lo in every if k == key(r.cost)]  # exact ties here, no rounding
        assert [r.layout, *r.variants] == same  # in ranked order, representative first


def test_row_one_is_the_layout_the_plan_writes_and_the_simplest_of_its_class():
    result = gpt175()
    rows = distinct(result, 5)
    assert rows[0].layout == result.layout(0)
    for r in rows:  # exact ties keep enumeration order: even split, lower ZeRO, flat DP first
        assert r.layout.stage_layers is None or all(v.stage_layers for v in r.variants)
        assert r.layout.zero_stage <= min(v.zero_stage for v in r.variants)
    assert rows[0].variant_note == "+1: zero 1/2"
    assert rows[1].variant_note == "+3: zero 1/2, split even/0-1-0"


def test_equal_means_within_a_tiny_relative_gap_in_step_time_and_memory():
    """Float rounding (1e-14) folds; a gap the model makes (1e-6, in time or memory) does not."""
    result = search(problem("tiny", "cpu-demo", "cpu-4x2"))
    result.costs = {k: np.array(v, copy=True) if np.ndim(v) else v
                    for k, v in result.costs.items()}
    step, mem = result.costs["step_time"], result.costs["mem_total"]
    j = next(i for i in range(result.count) if (step[i], mem[i]) != (step[0], mem[0]))
    assert result.layout(j) not in distinct(result, 1)[0].variants
    assert 1e-14 < EQUAL_COST_RTOL < 1e-6
    step[j], mem[j] = step[0] * (1 + 1e-14), mem[0] * (1 - 1e-14)
    assert result.layout(j) in distinct(result, 1)[0].variants
    step[j] = step[0] * (1 + 1e-6)  # apart in time
    assert result.layout(j) not in distinct(result, 1)[0].variants
    step[j], mem[j] = step[0], mem[0] * (1 + 1e-6)  # apart in memory
    assert result.layout(j) not in distinct(result, 1)[0].variants


def test_fewer_classes_than_asked_and_no_layout_at_all():
    result = search(problem("tiny", "cpu-demo", "cpu-4x2"))
    rows = distinct(result, 1000)
    assert 1 < len(rows) < result.count  # tiny has hierarchical-DP twins of equal cost
    assert sum(1 + len(r.variants) for r in rows) == result.count
    result.count = 0
    assert distinct(result, 5) == []


def test_json_rows_carry_their_variants():
    doc = json_document(gpt175(), 3, None, None, explain=False)
    first = doc["top"][0]
    assert first["variants_note"] == "+1: zero 1/2"
    assert [v["zero_stage"] for v in first["variants"]] == [2]
    assert first["layout"]["zero_stage"] == 1 and set(first) >= {"layout", "cost"}
    assert len({(r["cost"]["step_time"], r["cost"]["mem_total"]) for r in doc["top"]}) == 3
