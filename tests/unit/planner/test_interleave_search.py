"""Uneven and light-ends interleaving in the search, and the preference for the simpler layout
within the model's error."""

import numpy as np

from mscale.config import ClusterConfig, LayoutConfig, ModelConfig, TrainingConfig, check_layout
from mscale.config.layout import even_split
from mscale.planner.constants import MODEL_ERROR
from mscale.planner.cost import Problem, evaluate
from mscale.planner.search import interleavings, light_split, search

LLAMA_405B = ModelConfig(name="llama-405b", layers=126, hidden=16384, heads=128, kv_heads=8,
                         ffn_hidden=53248, vocab=128256, seq_len=8192)


def llama_problem() -> Problem:
    return Problem(LLAMA_405B, TrainingConfig(global_batch=2048, micro_batch=1),
                   ClusterConfig(nodes=1024, gpu="H100", nic_gbit_per_s=400), stack="llama3")


def test_126_layers_interleave_unevenly():
    """pp·v need not divide 126: pp 16 gets v 2, 3, 4 (two to four blocks per virtual stage) and
    v 8, Llama 3's split: 128 one-block slots whose first holds only the embedding and last only
    the head (searched only as that light-ends split)."""
    vs = interleavings(126, 16)
    assert {2, 3, 4, 8} <= set(vs) and 16 not in vs
    assert 7 in interleavings(126, 18)  # even: 126 = 18·7
    assert light_split(126, 16, 8) == even_split(126, 128) == [0] + [1] * 126 + [0]
    assert light_split(126, 16, 4) is None  # the default [1, 2, …, 2, 1] is light already
    split = light_split(126, 16, 3)
    assert split[0] == split[-1] == 1 and sum(split) == 126 and max(split) == 3
    assert even_split(126, 48)[0] == 2
    assert light_split(6, 2, 4) == [0, 1, 1, 1, 1, 1, 1, 0]  # 8 one-block slots, empty ends
    assert light_split(6, 2, 5) is None  # 10 stages for 6 blocks: a middle one would be empty


def test_empty_end_stages_are_costed_and_checked():
    """Llama 3's v 8 split passes the engine's layout check and costs less bubble than v 1."""
    pb = llama_problem()
    v8 = LayoutConfig(tp=8, pp=16, dp=64, vpp=8, sequence_parallel=True, zero_stage=1)
    check_layout(v8, pb.model, pb.training, pb.cluster)
    v1 = v8.model_copy(update={"vpp": 1})
    assert evaluate(pb, v8).t_bubble < evaluate(pb, v1).t_bubble / 4


def test_search_returns_valid_uneven_and_light_layouts():
    pb = llama_problem()
    r = search(pb)
    assert r.count > 0
    seen = {"uneven": False, "light": False}
    for i in range(r.count):
        lo = r.layout(i)
        if lo.vpp > 1 and 126 % (lo.pp * lo.vpp):
            seen["uneven"] = True
        if lo.stage_layers is not None:
            seen["light"] = True
            check_layout(lo, pb.model, pb.training, pb.cluster)
            assert evaluate(pb, lo).step_time == r.cost(i).step_time
        if all(seen.values()):
            break
    assert all(seen.values()), seen


def test_light_ends_unload_the_head_rank():
    """A 256k-token head costs more than a block: with an exact split the last rank carries it on
    top of its share; one block less on the first and last stages shortens the slowest rank."""
    model = ModelConfig(name="big-vocab", layers=32, hidden=4096, heads=32, kv_heads=8,
                        ffn_hidden=14336, vocab=256000, seq_len=4096)
    pb = Problem(model, TrainingConfig(global_batch=512, micro_batch=1, recompute="full",
                                       zero_stage=1),
                 ClusterConfig(nodes=8, gpu="H100"), stack="megatron-core")
    r = search(pb)
    arr, step = r.arrays, r.costs["step_time"]
    light = [i for i in range(r.count) if arr["light"][i] and arr["pp"][i] == 4
             and arr["vpp"][i] == 1 and arr["tp"][i] == 8]
    even = [i for i in range(r.count) if not arr["light"][i] and arr["pp"][i] == 4
            and arr["vpp"][i] == 1 and arr["tp"][i] == 8]
    assert light and even
    assert r.layout(light[0]).stage_layers == [7, 9, 9, 7]
    assert min(step[light]) < min(step[even])


def test_simpler_layout_within_the_error_comes_first_with_a_reason():
    pb = llama_problem()
    r = search(pb)
    steps = r.costs["step_time"][: r.count]
    fastest = float(np.min(steps))
    first = r.layout(0)
    assert steps[0] <= fastest * (1 + MODEL_ERROR)
    band = [i for i in range(r.count) if steps[i] <= fastest * (1 + MODEL_ERROR)]
    assert first.vpp == min(r.layout(i).vpp for i in band)
    if steps[0] > fastest:
        assert "within the model's" in r.preferred_note and f"v{first.vpp}" in r.preferred_note
