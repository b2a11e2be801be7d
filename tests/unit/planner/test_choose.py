"""planner/choose.py: which layout becomes the plan (best or given), what is refused before the
search, --calibrate's need for the layout a run used, and a whole plan given as one part. The
CLI's end-to-end checks of the same are in tests/unit/cli/test_plan.py."""

from __future__ import annotations

import pytest

import mscale.planner.choose as choose_mod
from mscale.config import ModelConfig
from mscale.errors import MscaleError
from mscale.planner.choose import choose, load_part, load_parts

from tests.conftest import PLANS

CPU = (str(PLANS / "models" / "tiny.yaml"), str(PLANS / "training" / "cpu-demo.yaml"),
       str(PLANS / "clusters" / "cpu-4x2.yaml"))


@pytest.fixture(scope="module")
def configs():
    return load_parts(*CPU)


def test_the_best_layout_is_chosen_and_the_given_one_priced_beside_it(configs):
    c = choose(configs, options={"tp": 2, "pp": 2, "micro_batch": 2})
    assert c.layout == c.result.layout(0) and c.cost == c.result.cost(0)
    assert (c.given[0].tp, c.given[0].pp, c.given[0].dp) == (2, 2, 2)
    kept = choose(configs, options={"tp": 2, "pp": 2, "micro_batch": 2}, keep_given=True)
    assert kept.layout == kept.given[0] and kept.cost == kept.given[1]


def test_refusals_come_before_the_search(configs, monkeypatch):
    monkeypatch.setattr(choose_mod, "search", lambda pb: pytest.fail("searched"))
    with pytest.raises(MscaleError, match="--keep-given needs a given layout"):
        choose(configs, keep_given=True)
    with pytest.raises(MscaleError) as e:
        choose(configs, stack="no-such-stack")
    assert e.value.code == 3
    with pytest.raises(MscaleError) as e:
        choose(configs, options={"tp": 3})
    assert e.value.field == "layout.tp"


def test_a_given_layout_that_does_not_fit_is_not_written(configs, monkeypatch):
    c = choose(configs, options={"tp": 1, "pp": 1})
    budget = c.given[1].mem_total * 0.99  # the given layout misses by 1%; others fit
    monkeypatch.setattr(type(c.problem), "budget_bytes", property(lambda pb: budget))
    with pytest.raises(MscaleError, match="the given layout needs") as e:
        choose(configs, options={"tp": 1, "pp": 1}, keep_given=True)
    assert e.value.field == "layout" and "the best layout that fits is" in e.value.fix


def test_a_run_s_step_time_calibrates_only_against_the_layout_it_ran(configs):
    metrics = str(PLANS.parent / "bench" / "data" / "h200_gpu1b_metrics.jsonl")
    with pytest.raises(MscaleError, match="calibrates against the layout that run used") as e:
        choose(configs, calibrate=[metrics])
    assert e.value.field == "--calibrate"


def test_a_whole_plan_given_as_one_part_is_named_as_such():
    path = str(PLANS / "cpu-tiny.yaml")
    with pytest.raises(MscaleError, match="this looks like a whole plan") as e:
        load_part(ModelConfig, path, "--model")
    assert e.value.field == "--model" and f"--layout {path}" in e.value.fix
