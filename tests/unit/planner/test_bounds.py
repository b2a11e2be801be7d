"""Inputs at the edges of the schemas: the planner answers, or refuses with an MscaleError,
after a bounded amount of work whatever the model and cluster; no loop grows with the layer or
GPU count.

The work is counted, not timed (a wall-clock limit fails on a loaded machine): the search's
costly step is spelling out a stage split (`even_split`, one list entry per virtual stage), so
the tests count the splits and the stage entries a search builds. Before the split rule was
computed as a window and the light-ends check cached, the refused search below built ~16,500
splits (~35 M entries, 10-16 s); now ~1,600 (2.1 M, 0.3 s)."""

from __future__ import annotations

import pytest

from mscale.config import ClusterConfig, ModelConfig, TrainingConfig
from mscale.config import layout as layout_module
from mscale.config.layout import even_split
from mscale.errors import MscaleError
from mscale.planner.cost import Problem, counts_of, rank_layer_counts
from mscale.planner.given import given_layout
from mscale.planner.goodput import GoodputInputs
from mscale.planner import cost as cost_module
from mscale.planner import search as search_module
from mscale.planner.search import search

MAX_SPLITS = 4_000
MAX_STAGE_ENTRIES = 4_000_000
"""About twice what the largest case below builds (1,596 splits, 2.1 M entries)."""


@pytest.fixture
def split_work(monkeypatch):
    """[splits built, stage entries spelled out] during the test, by every caller in the planner."""
    work = [0, 0]

    def counting(layers: int, stages: int) -> list[int]:
        work[0] += 1
        work[1] += stages
        return layout_module.even_split(layers, stages)

    for module in (search_module, cost_module):
        monkeypatch.setattr(module, "even_split", counting)
    search_module.light_counts.cache_clear()  # count what a fresh process would do
    return work


def problem(layers: int, nodes: int, global_batch: int = 1 << 24) -> Problem:
    """A 175B-wide model with any layer count: built without validation, as the planner must not
    rely on the model schema's bounds."""
    fields = ModelConfig(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048).__dict__
    model = ModelConfig.model_construct(**{**fields, "layers": layers})
    return Problem(model, TrainingConfig(global_batch=global_batch),
                   ClusterConfig(nodes=nodes, gpus_per_node=8, gpu="A100"))


@pytest.mark.parametrize("layers, nodes", [(10**9, 1), (10_000, 131_072), (720_720, 1)])
def test_huge_layer_or_gpu_counts_search_with_bounded_work(layers, nodes, split_work):
    r = search(problem(layers, nodes))
    assert r.examined > 0
    assert split_work[0] <= MAX_SPLITS and split_work[1] <= MAX_STAGE_ENTRIES, split_work


def test_a_search_space_too_large_is_refused_after_bounded_work(split_work):
    with pytest.raises(MscaleError, match="combinations") as e:
        search(problem(735_134_400, 131_072))  # 1,344 divisors × 2^20 GPUs × 16 micro-batches
    assert "micro_batch" in e.value.fix
    assert split_work[0] <= MAX_SPLITS and split_work[1] <= MAX_STAGE_ENTRIES, split_work


def test_closed_form_layer_counts_match_the_split():
    for layers in range(1, 40):
        for pp in range(1, layers + 1):
            for vpp in range(1, layers // pp + 1):
                split = even_split(layers, pp * vpp)
                per_rank = [sum(split[r::pp]) for r in range(pp)]
                assert rank_layer_counts(layers, pp, vpp) == counts_of(per_rank), (layers, pp,
                                                                                  vpp)


@pytest.mark.parametrize("field, value", [
    ("failures_per_1000_node_days", 0.0), ("failures_per_1000_node_days", float("nan")),
    ("restart_s", float("inf")), ("write_gb_per_s", -1.0),
])
def test_goodput_inputs_that_leave_the_advice_undefined(field, value):
    with pytest.raises(MscaleError, match="finite"):
        GoodputInputs(**{field: value})


@pytest.mark.parametrize("text, message", [("tp: abc\n", "valid integer"),
                                           ("tp: [2]\n", "valid integer"),
                                           ("pp: true\n", "valid integer")])
def test_given_layout_file_types_are_checked_before_arithmetic(tmp_path, text, message):
    f = tmp_path / "layout.yaml"
    f.write_text(text)
    with pytest.raises(MscaleError, match=message) as e:
        given_layout(problem(96, 2), {}, str(f))
    assert e.value.file == str(f) and e.value.field.startswith("layout.")
