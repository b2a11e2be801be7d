"""The stage split and the engine-side refusals, without processes."""

import pytest
import torch

from mscale.errors import MscaleError
from mscale.parallel.parallelize import build_chunks
from mscale.parallel.pipeline.stages import ChunkSpec, check_pipeline, rank_chunks, stage_layer_ids
from mscale.parallel.tensor import TensorParallel
from tests.distributed.pipeline_plan import tiny_plan


def test_stage_layer_ids_are_consecutive_global_blocks():
    assert stage_layer_ids([1, 2, 2, 1]) == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.parametrize("rank,expected", [(0, [([0], True, False), ([3, 4], False, False)]),
                                           (1, [([1, 2], False, False), ([5], False, True)])])
def test_interleaved_chunks_follow_megatron_assignment(rank, expected):
    """pp=2, vpp=2, 6 blocks split [1, 2, 2, 1]: rank r holds virtual stages r and r+2."""
    plan = tiny_plan(1, 2, 2, vpp=2)
    chunks, _ = build_chunks(plan, rank, TensorParallel.single(), torch.device("cpu"))
    got = [([int(i) for i in c.layers], c.has_embedding, c.has_head) for c in chunks]
    assert got == expected
    names = {n for c in chunks for n, _ in c.named_parameters()}
    assert ("embed.weight" in names) == (rank == 0) and ("head.weight" in names) == (rank == 1)


def test_first_and_last_virtual_stage_may_hold_no_block():
    """[0, 3, 3, 0]: rank 0's first chunk is the embedding alone, rank 1's last the head alone."""
    plan = tiny_plan(1, 2, 2, vpp=2, stage_layers=[0, 3, 3, 0])
    check_pipeline(plan)
    assert rank_chunks(plan, 0) == [ChunkSpec((), True, False), ChunkSpec((3, 4, 5), False, False)]
    assert rank_chunks(plan, 1) == [ChunkSpec((0, 1, 2), False, False), ChunkSpec((), False, True)]
    (first, _), _ = build_chunks(plan, 0, TensorParallel.single(), torch.device("cpu"))
    assert [n for n, _ in first.named_parameters()] == ["embed.weight"]


def test_a_middle_stage_without_blocks_is_refused():
    plan = tiny_plan(1, 2, 2, vpp=2, stage_layers=[0, 3, 3, 0])
    plan.layout.stage_layers = [2, 0, 3, 1]  # bypasses the plan's own check, as a hand edit might
    with pytest.raises(MscaleError, match="middle stage 1") as e:
        check_pipeline(plan)
    assert e.value.field == "layout.stage_layers"


def test_without_pipelining_one_chunk_holds_the_whole_model():
    plan = tiny_plan(2, 1, 2)
    assert rank_chunks(plan, 0) == [ChunkSpec(tuple(range(plan.model.layers)), True, True)]
    (chunk,), _ = build_chunks(plan, 0, TensorParallel.single(), torch.device("meta"))
    assert [int(i) for i in chunk.layers] == list(range(plan.model.layers))
    assert chunk.has_embedding and chunk.has_head


@pytest.mark.parametrize("kw,match", [
    (dict(pp=4, global_batch=6), "cannot fill"),  # 3 micro-batches < 4 stages
    (dict(pp=2, vpp=2, global_batch=6), "divisible"),  # 3 micro-batches, pp=2
    (dict(pp=2, tie_embeddings=True), "tied embeddings"),
])
def test_engine_refuses_what_the_pipeline_cannot_run(kw, match):
    pp = kw.pop("pp")
    with pytest.raises(MscaleError, match=match):
        check_pipeline(tiny_plan(1, pp, 1, **kw))
