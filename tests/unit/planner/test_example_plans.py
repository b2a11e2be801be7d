"""The example plans under plans/ are what today's planner writes: each written plan's layout
still fits and its estimate is today's price of that layout (they had drifted: one 175B plan's
layout needed 240 GB per GPU once the memory model priced this engine)."""

import pytest

from mscale.config.base import parse_yaml, validate
from mscale.config.plan import Plan
from mscale.planner.cost import Problem, evaluate

from tests.conftest import PLANS

WRITTEN = sorted(p for p in PLANS.glob("*.yaml") if "estimate:" in p.read_text())


def test_there_are_written_example_plans():
    assert len(WRITTEN) >= 5


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.stem)
def test_an_example_plan_is_priced_as_the_planner_prices_it_today(path):
    doc = parse_yaml(path.read_text(), str(path))  # the loader plans are read with
    doc.pop("placement", None)  # 12,288 ranks' map: not what is checked here, slow to validate
    plan = validate(Plan, doc, str(path))
    cost = evaluate(Problem(plan.model, plan.training, plan.cluster), plan.layout)
    assert bool(cost.fits), f"{path.name}: its layout no longer fits; regenerate it"
    assert plan.estimate["step_time_s"] == pytest.approx(cost.step_time, rel=1e-3), (
        f"{path.name}: estimate is stale; regenerate it with the command in its header")
    assert plan.estimate["memory"]["total_gb"] == pytest.approx(cost.mem_total / 1e9, rel=1e-3)
