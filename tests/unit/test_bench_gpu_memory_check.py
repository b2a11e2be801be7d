"""bench/gpu_memory_check.py, the parts a CPU can check: the planner's figure is priced for the
stack the run used (compiled: ``mscale``; not: ``mscale-eager``; a training file's own stack
kept), as gpu_plans prices a plan, and each line names that stack. The run itself (a GPU, or
``--cpu``: ~15 s a case) is not repeated here."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("gpu_memory_check")
    finally:
        sys.path.remove(str(BENCH))


def case(check, **training) -> dict:
    return {"zero": 1, "gpn": 1, "model": {"name": "m", **check.MODELS["gpu"]},
            "training": {"global_batch": 8, "precision": "bf16", "bucket_mb": 25.0, "steps": 2,
                         **training}}


def test_the_stack_is_the_one_the_engine_ran(check):
    from tests.distributed.memory_cases import planned

    c = case(check)
    plan, stack = check.planner_figures(c, "H200", compiled=True)
    assert stack == "mscale"
    want = planned({**c, "training": {**c["training"], "compile": True}}, "H200")
    assert plan == want and plan["mem_total"] > 0
    assert check.planner_figures(c, "H200", compiled=False)[1] == "mscale-eager"
    assert check.planner_figures(c, None, compiled=False)[1] == "mscale-eager"  # --cpu


def test_a_training_file_naming_another_stack_keeps_it(check):
    plan, stack = check.planner_figures(case(check, stack="megascale"), "H200", compiled=True)
    ours, _ = check.planner_figures(case(check), "H200", compiled=True)
    assert stack == "megascale" and plan["mem_total"] != ours["mem_total"]  # Megatron's count


def test_a_line_names_the_stack_and_the_verdict(check):
    plan = {k: 2**30 for k in ("mem_weights", "mem_gradients", "mem_optimizer",
                               "mem_activations", "mem_weight_copies", "mem_logits")}
    plan["mem_total"] = 1.05 * 2**30
    ok, line = check.case_line("mb 4", 2**30, plan, "mscale")
    assert ok and line.startswith("PASS mb 4: measured 1.000 GiB, planned 1.050 GiB for stack "
                                  "mscale (+5.0%); weights 1.00, ")
    ok, line = check.case_line("mb 4", 1.2 * 2**30, plan, "mscale-eager")
    assert not ok and line.startswith("FAIL mb 4:") and "stack mscale-eager (-12.5%)" in line
