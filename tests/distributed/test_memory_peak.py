"""The planner's bytes per rank against the running engine's peak, on CPU (gloo).

Measured with `memory_cases.LiveBytes` (every tensor storage an operator creates, counted while
it lives) over two training steps of the real engine; compared with `planner.memory.rank_memory`
for the same plan. Tolerance: the plan may exceed the peak by up to 8% (it counts a backward
working set the allocator may not reach) and fall short by at most 5%. Measured when written
(bf16, h 256, s 128, 4 layers): −4.4% (pp 2 v 2, micro-batch 1: the first rank peaks in the
embedding's backward, its dense fp32 gradient, ~1.1 MB, not modelled) to +4.7% (parallel GeLU
block); ZeRO 1 and 2 +2.8%, 1F1B +1.6%, TP+SP with a sliding window +2.9%.

bf16 weight copies: the engine casts each weight once per step, shared by every micro-batch in
flight (`Precision.cast_scope`). Against one autocast context per forward (a copy per micro-batch
in flight), the pipeline peaks dropped 42.68 → 40.46 MB (1F1B, 2 in flight) and 40.55 → 37.27
MB (interleaved, 2.5 in flight); the planner's copies term went with them (4.72 → 2.36 and
5.90 → 2.36 MB). Gradient accumulation without a pipeline holds one micro-batch: unchanged.

A GPU's figure (`torch.cuda.max_memory_allocated`) is bench/gpu_memory_check.py; the process's
RSS is no measure of either (interpreter, libraries, gloo buffers, freed pages glibc keeps).
"""

import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.memory_cases import case_of, measure, planned

pytestmark = pytest.mark.dist

OVER, UNDER = 0.08, 0.05
CASES = {
    1: [("base", {"zero": 0}, {}, {}),
        ("full recompute", {"zero": 0, "recompute": "full"}, {}, {}),
        ("fp32", {"zero": 0}, {}, {"precision": "fp32"}),
        ("parallel gelu", {"zero": 0}, {"parallel_block": True, "mlp": "gelu",
                                         "ffn_hidden": 1024}, {})],
    2: [("dp zero 1", {"dp": 2, "zero": 1}, {}, {}),
        ("dp zero 2", {"dp": 2, "zero": 2}, {}, {}),
        ("pp 1F1B", {"pp": 2, "zero": 1}, {}, {}),
        ("pp interleaved", {"pp": 2, "vpp": 2, "zero": 1, "mb": 1}, {}, {}),
        ("tp sp", {"tp": 2, "sp": True, "zero": 1}, {"sliding_window": 32}, {})],
}


def measure_all(rank: int, world: int, cases: list[dict], shared: bool = True) -> list[dict]:
    """Each case's peak; ``shared`` False: with one autocast context per forward, as the engine
    was before `Precision.cast_scope` (a bf16 weight copy per micro-batch in flight)."""
    if not shared:
        from tests.distributed.test_weight_casts import per_forward_casts

        per_forward_casts()
    return [measure(rank, world, c) for c in cases]


def _measured(world: int):
    cases = [case_of(lay, model, tr) for _, lay, model, tr in CASES[world]]
    per_rank = run_distributed(measure_all, world, cases, timeout_s=120)
    return [(name, max(r[i]["peak"] for r in per_rank), planned(cases[i]))
            for i, (name, *_) in enumerate(CASES[world])]


@pytest.fixture(scope="module")
def two_ranks():
    """The world-2 cases (data parallel, pipeline, TP), measured once for the module."""
    return _measured(2)


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request, two_ranks):
    """Every case of one world size."""
    return two_ranks if request.param == 2 else _measured(request.param)


def test_planned_bytes_match_the_engine_peak(results):
    for name, peak, plan in results:
        ratio = plan["mem_total"] / peak
        assert 1 - UNDER <= ratio <= 1 + OVER, (
            f"{name}: planned {plan['mem_total'] / 1e6:.2f} MB, engine peak {peak / 1e6:.2f} MB "
            f"({ratio - 1:+.1%})")


def test_zero2_does_not_lower_the_engine_peak(two_ranks):
    """The engine keeps every bucket's full gradient from the first backward to the reduction,
    so ZeRO-2's peak is ZeRO-1's; the planner says so too (it divided by dp before)."""
    by_name = {name: (peak, plan) for name, peak, plan in two_ranks}
    (p1, plan1), (p2, plan2) = by_name["dp zero 1"], by_name["dp zero 2"]
    assert p2 == pytest.approx(p1, rel=0.01)
    assert plan2["mem_total"] == pytest.approx(plan1["mem_total"])


def test_pipeline_peaks_drop_by_the_copies_no_longer_kept_per_micro_batch(two_ranks):
    """The first rank held a bf16 copy of its blocks' weights per micro-batch in flight (1F1B:
    2, interleaved: 2.5); now one. Measured drop ≥ 85% of that difference (93-94% when
    written: the peak moves to another moment of the schedule)."""
    from mscale.config import ModelConfig
    from mscale.planner import flops
    from mscale.planner.memory import in_flight_micro_batches

    names = ["pp 1F1B", "pp interleaved"]
    spec = {name: case_of(lay, model, tr) for name, lay, model, tr in CASES[2]}
    cases = [spec[n] for n in names]
    old = run_distributed(measure_all, 2, cases, False, timeout_s=120)
    peaks = {name: peak for name, peak, _ in two_ranks}
    for i, name in enumerate(names):
        c = cases[i]
        micro = c["training"]["global_batch"] // c.get("mb", 2)
        worth = float(in_flight_micro_batches(c["pp"], c.get("vpp", 1), micro))
        layers_per_rank = c["model"]["layers"] // c["pp"]
        copy = 2 * flops.layer_matrix_params(ModelConfig(**c["model"])) * layers_per_rank
        drop = max(r[i]["peak"] for r in old) - peaks[name]
        assert drop >= 0.85 * (worth - 1) * copy, (name, drop, (worth - 1) * copy)
