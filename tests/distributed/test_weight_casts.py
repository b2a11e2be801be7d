"""bf16 autocast: one bf16 copy of each weight per optimizer step, shared by every micro-batch.

The engine holds one outermost autocast context over a step's forwards and backwards
(`Precision.cast_scope`), so autocast's cast cache lives for the whole step instead of one chunk
forward. Checked here on the real engine (bf16 on CPU, gloo):

- the weights are cast once per step, not once per micro-batch (plain gradient accumulation,
  m = 4: the graph of each micro-batch is freed before the next, so only a cast count shows it);
- the numerics do not change: per-step losses and every parameter after 3 AdamW steps are
  bit-identical to the engine with one autocast context per forward (the old behaviour), for
  gradient accumulation, 1F1B, interleaved 1F1B, TP+SP and selective recompute.

The memory it saves in pipelines is tests/distributed/test_memory_peak.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed.engine_cases import run_case
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist
STEPS = 3
BF16 = {"precision": "bf16"}
MODEL = {"layers": 4}


def _case(**layout) -> dict:
    return {**layout, "model": MODEL, "training": {**BF16, **layout.pop("training", {})}}


CASES = {
    1: {"accumulation m4": _case(zero=0),
        "selective m4": _case(zero=0, recompute="selective")},
    2: {"pp 1F1B m4": _case(pp=2, zero=1),
        "pp interleaved m8": _case(pp=2, vpp=2, mb=1),
        "tp sp m4": _case(tp=2, sp=True)},
}


def per_forward_casts() -> None:
    """The engine as it was: no step-long scope, so each forward's autocast is outermost and
    its cast cache dies with it (a copy per micro-batch)."""
    from mscale.parallel.precision import Precision

    Precision.cast_scope = lambda self: contextlib.nullcontext()


def train(rank: int, world: int, cases: list[dict], shared: bool) -> list[dict]:
    if not shared:
        per_forward_casts()
    return [run_case(rank, world, case, STEPS) for case in cases]


@pytest.fixture(scope="module", params=sorted(CASES))
def pairs(request):
    world = request.param
    cases = list(CASES[world].values())
    old = run_distributed(train, world, cases, False, timeout_s=120)
    new = run_distributed(train, world, cases, True, timeout_s=120)
    return [(name, [r[i] for r in old], [r[i] for r in new])
            for i, name in enumerate(CASES[world])]


def test_sharing_the_cast_does_not_change_the_numerics(pairs):
    for name, old, new in pairs:
        for a, b in zip(old, new):
            assert a["losses"] == b["losses"], name
            assert a["params"].keys() == b["params"].keys()
            for k in a["params"]:
                assert torch.equal(a["params"][k], b["params"][k]), f"{name}: {k}"


def count_weight_casts(rank: int, world: int, case: dict, shared: bool) -> list[int]:
    """Casts of a parameter per step (``_to_copy`` of a leaf ``nn.Parameter``), 2 steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mscale.train.loop import train_step
    from mscale.train.timers import StepTimer
    from tests.distributed.engine_cases import build_case_engine

    if not shared:
        per_forward_casts()
    engine = build_case_engine(rank, world, case)
    params = {id(p) for p in engine.params}
    counts = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and id(args[0]) in params:
                counts[-1] += 1
            return func(*args, **(kwargs or {}))

    timer = StepTimer()
    with Casts():
        for step in range(2):
            counts.append(0)
            timer.start_step()
            train_step(engine, step, timer)
            timer.end_step()
    engine.param_buffer.wait()
    engine.grads.close()
    return counts


def test_each_weight_is_cast_once_per_step_not_per_micro_batch():
    case = _case(zero=0)  # global batch 8, micro-batch 2: m = 4
    matrices = 4 * 7 + 1  # per block Q, K, V, O, gate, up, down; the head
    (shared,) = run_distributed(count_weight_casts, 1, case, True, timeout_s=60)
    (old,) = run_distributed(count_weight_casts, 1, case, False, timeout_s=60)
    assert shared == [matrices, matrices]  # again in step 2: the updated weights
    assert old == [4 * matrices, 4 * matrices]
