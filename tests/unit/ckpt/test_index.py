"""Schema 2: each shard's slices in its own index file. The manifest names every tensor once (the
rank holding one element, chosen from the name, reports it), a resuming rank reads the indexes
of the shards `likely_writers` names and no others, a wrong guess widens to every index rather
than fail, and schema-1 checkpoints (slices inline) still load and verify."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mscale.ckpt import catalog, files
from mscale.ckpt.commit import reported_tensors
from mscale.ckpt.load import CheckpointReader, model_needs, optim_needs
from mscale.ckpt.locate import likely_writers, overlapping_shards
from mscale.ckpt.manifest import COMMITTED, MANIFEST, index_name, sha256
from mscale.ckpt.ownership import for_plan, write_items
from mscale.ckpt.slices import intersect, region_boxes
from mscale.ckpt.verify import verify
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic

LAYOUT = dict(tp=2, pp=2, dp=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    p = plan(**LAYOUT)
    tensors = global_state(p)
    path = str(tmp_path_factory.mktemp("idx") / "step-000005")
    write_synthetic(path, p, tensors)
    return path, p, tensors


@pytest.mark.parametrize("layout", [LAYOUT, dict(tp=2, pp=1, dp=4, zero=0),
                                    dict(tp=1, pp=2, dp=4, zero=1, hier=True)],
                         ids=["zero1", "zero0", "hierarchical"])
def test_every_tensor_is_reported_by_exactly_one_rank(layout):
    p = plan(**layout)
    written, named = set(), []
    for r in range(p.layout.world_size):
        items = write_items(for_plan(p, r))
        written |= {it.key for it in items}
        named += list(reported_tensors(items))
    assert sorted(named) == sorted(written) and len(named) == len(set(named))


def test_the_tensors_of_a_sharded_stage_are_named_by_ranks_spread_over_its_shards():
    """The gather pads every report to the largest: naming by element 0 put a stage's whole
    table on its first ZeRO shard."""
    p = plan(tp=1, pp=1, dp=8, bucket_mb=0.002)
    counts = [len(reported_tensors(write_items(for_plan(p, r)))) for r in range(8)]
    assert sum(counts) > 20 and max(counts) < sum(counts) / 2, counts


def test_the_manifest_lists_shards_and_each_index_names_its_shard(saved):
    path, p, _ = saved
    m = catalog.load_committed(path)
    assert m.schema_version == 2 and len(m.shards) == p.layout.world_size
    for shard in m.shards:
        assert shard.slices == [] and shard.index.path == index_name(shard.rank)
        slices = files.shard_slices(path, m, shard)
        assert slices and {s.tensor for s in slices} <= set(m.tensors)
    assert verify(path).problems == []


def _read_needs(reader, rl) -> dict:
    return {(it.key, it.box, it.flat): reader.read_item(it)
            for it in optim_needs(rl) + model_needs(rl)}


def test_a_rank_at_the_same_layout_reads_its_likely_writers_only(saved):
    path, p, tensors = saved
    m = catalog.load_committed(path)
    for r in range(p.layout.world_size):
        rl = for_plan(p, r)
        prefer = likely_writers(p, p, rl, optimizer=True)
        assert r in prefer and len(prefer) <= 2  # its own shard, and TP rank 0's replicated
        with CheckpointReader(path, m, prefer=prefer) as reader:
            for it in optim_needs(rl):
                box = tuple(slice(a, b) for a, b in it.box)
                want = tensors[it.key][box].reshape(-1)[it.flat[0]: it.flat[1]]
                assert torch.equal(reader.read_item(it), want), it.key
            assert reader.indexes_read == len(prefer)  # no miss: nothing else was read


def test_a_new_dp_size_reads_its_coordinate(saved):
    path, p, _ = saved
    m = catalog.load_committed(path)
    wider = plan(tp=2, pp=2, dp=4)
    rl = for_plan(wider, 5)
    prefer = likely_writers(p, wider, rl, optimizer=True)
    assert len(prefer) <= 4
    with CheckpointReader(path, m, prefer=prefer) as reader:  # what a ZeRO-1 resume reads
        for it in optim_needs(rl):
            reader.read_item(it)
        assert reader.indexes_read == len(prefer)


RESPLITS = [  # (the saving layout, the resuming one, whether the optimizer state is saved, the
    # most indexes a rank reads of the 8: a rank of one stage never reads the other stage's)
    (LAYOUT, dict(tp=1, pp=2, dp=4), True, 4),
    (LAYOUT, dict(tp=2, pp=1, dp=3), True, 6),
    (dict(tp=1, pp=2, dp=4), dict(tp=2, pp=1, dp=2), True, 8),
    (dict(tp=1, pp=2, dp=4, hier=True), dict(tp=2, pp=1, dp=4, hier=True), True, 8),
    (dict(tp=2, pp=1, dp=4, zero=0), dict(tp=1, pp=2, dp=2, zero=0), True, 8),
    (LAYOUT, dict(tp=1, pp=1, dp=2), False, 8),
    (dict(tp=2, pp=2, dp=2, zero=0), LAYOUT, True, 4),  # another ZeRO stage at the same split
    (LAYOUT, dict(tp=2, pp=2, dp=2, zero=0), True, 4),
]


def _needs(rl, optimizer: bool) -> list:
    """What `load.read_for_rank` reads for ``rl``."""
    if not optimizer:
        return model_needs(rl)
    return [] if rl.zero_stage == 0 and rl.dp_rank != 0 else optim_needs(rl)


def _holders(path, m, needs) -> set[int]:
    """The ranks whose index files list a slice overlapping ``needs``, read from disk."""
    wanted: dict[str, list] = {}
    for it in needs:
        wanted.setdefault(it.key, []).extend(b for b, _ in region_boxes(it.box, it.flat))
    return {shard.rank for shard in m.shards
            for s in files.shard_slices(path, m, shard) if s.tensor in wanted
            and any(intersect(b, w) is not None for w in wanted[s.tensor]
                    for b, _ in region_boxes(s.box_tuple(), tuple(s.flat)))}


@pytest.mark.parametrize("old, new, optimizer, most", RESPLITS,
                         ids=["tp2-to-1", "pp2-to-1", "pp-to-tp", "pp-to-tp-hier", "zero0",
                              "model-only", "zero0-to-1", "zero1-to-0"])
def test_at_a_new_tp_pp_split_a_rank_reads_exactly_the_indexes_holding_its_state(
        tmp_path, old, new, optimizer, most):
    """recover's planner search and `ckpt convert` change the split: a rank reads the indexes of
    the old ranks whose slices overlap what it reads, no more (each one holds some of it) and no
    fewer (no widening), instead of all of them."""
    saved, resumed = plan(**old), plan(**new)
    tensors = global_state(saved, optimizer=optimizer)
    path = str(tmp_path / "step-000005")
    write_synthetic(path, saved, tensors)
    m = catalog.load_committed(path)
    counts = []
    for r in range(resumed.layout.world_size):
        rl = for_plan(resumed, r)
        needs = _needs(rl, optimizer)
        prefer = likely_writers(saved, resumed, rl, optimizer)
        assert prefer == _holders(path, m, needs), r
        counts.append(len(prefer))
        with CheckpointReader(path, m, prefer=prefer) as reader:
            for it in needs:
                box = tuple(slice(a, b) for a, b in it.box)
                want = tensors[it.key][box].reshape(-1)[it.flat[0]: it.flat[1]]
                assert torch.equal(reader.read_item(it), want), (r, it.key)
            assert not reader.widened and reader.indexes_read == len(prefer), r
    assert max(counts) == most, counts


@pytest.mark.parametrize("hier", [False, True])
def test_after_recover_shrinks_dp_a_rank_reads_the_shards_overlapping_its_own(tmp_path, hier):
    """recover's first re-plan keeps tp/pp and shrinks DP: each new ZeRO shard overlaps a few
    old ones, so a rank reads those indexes, not its coordinate's every replica (tp 1: two
    ranks a node, so hierarchical DP permutes the shards)."""
    big = plan(tp=1, pp=1, dp=8, hier=hier)
    path = str(tmp_path / "step-000005")
    write_synthetic(path, big, global_state(big))
    m = catalog.load_committed(path)
    small = plan(tp=1, pp=1, dp=2, hier=hier)
    for r in range(small.layout.world_size):
        rl = for_plan(small, r)
        prefer = likely_writers(big, small, rl, optimizer=True)
        assert len(prefer) <= 5, prefer  # of 8: half the buckets, and a neighbour at the edges
        with CheckpointReader(path, m, prefer=prefer) as reader:
            for it in optim_needs(rl):
                reader.read_item(it)
            assert reader.indexes_read == len(prefer), r  # no miss


def test_a_zero_0_replica_reads_no_index_but_its_own():
    p = plan(tp=1, pp=1, dp=4, zero=0)
    assert likely_writers(p, p, for_plan(p, 2), optimizer=True) == {2}
    assert len(likely_writers(p, p, for_plan(p, 0), optimizer=True)) == 4


def test_a_wrong_guess_widens_to_every_index_and_reads_the_same(saved):
    path, p, _ = saved
    m = catalog.load_committed(path)
    rl = for_plan(p, 3)
    with CheckpointReader(path, m) as everything:
        want = _read_needs(everything, rl)
    with CheckpointReader(path, m, prefer=[0]) as reader:  # not where rank 3's state is
        got = _read_needs(reader, rl)
        assert reader.indexes_read == p.layout.world_size and reader.widened
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def _as_schema_1(path: str) -> None:
    """Rewrite a checkpoint in the format before schema 2: slices inline, no index files."""
    m = catalog.load_committed(path)
    doc = json.loads(m.model_dump_json())
    doc["schema_version"] = 1
    for shard, entry in zip(m.shards, doc["shards"]):
        entry["slices"] = [json.loads(s.model_dump_json())
                           for s in files.shard_slices(path, m, shard)]
        entry.pop("index")
        os.remove(os.path.join(path, shard.index.path))
    raw = json.dumps(doc).encode()
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(raw)
    marker = json.loads(open(os.path.join(path, COMMITTED)).read())
    marker["manifest_sha256"] = sha256(raw)
    with open(os.path.join(path, COMMITTED), "w") as f:
        json.dump(marker, f)


def test_schema_1_checkpoints_still_verify_and_load(saved, tmp_path):
    path, p, tensors = saved
    old = str(tmp_path / "step-000005")
    write_synthetic(old, p, tensors)
    _as_schema_1(old)
    assert not [f for f in os.listdir(old) if f.endswith(".index.json")]
    assert verify(old).problems == []
    m = catalog.load_committed(old)
    assert m.schema_version == 1
    rl = for_plan(p, 6)
    with CheckpointReader(old, m, prefer=likely_writers(p, p, rl, True)) as reader, \
            CheckpointReader(path, catalog.load_committed(path)) as new:
        got, want = _read_needs(reader, rl), _read_needs(new, rl)
    assert all(torch.equal(want[k], got[k]) for k in want)


def _shard_of_each_element(fills: list[int], dp: int) -> list[int]:
    out = []
    for f in fills:
        n = -(-f // dp)
        out += [e // n for e in range(f)]
    return out


@pytest.mark.parametrize("fills, dp, saved_dp", [
    ([9], 2, 8), ([7], 6, 8), ([3], 4, 8), ([12288], 124, 128),  # a review's counterexamples
    ([5, 1, 64, 30], 3, 5), ([100, 7], 8, 3), ([1, 1, 1], 2, 4), ([4096, 12], 191, 192),
])
def test_overlapping_shards_are_exactly_those_holding_an_element(fills, dp, saved_dp):
    """Element by element: the saved shards that hold any element of new shard i, for every
    i, including buckets too small for a fixed margin."""
    new, old = _shard_of_each_element(fills, dp), _shard_of_each_element(fills, saved_dp)
    for i in range(dp):
        want = {o for n, o in zip(new, old) if n == i}
        assert overlapping_shards(i, fills, dp, fills, saved_dp) == want, i


def test_a_scalar_and_an_empty_tensor_are_named_once():
    """crc32 picks an element; a tensor with none is named by its slice at the origin."""
    from mscale.ckpt.ownership import Item

    def item(key, shape, box, flat):
        return Item(key, shape, "float32", box, flat, ())
    items = [item("empty", (3, 0), ((0, 3), (0, 0)), (0, 0)),
             item("empty", (3, 0), ((3, 3), (0, 0)), (0, 0)),  # another rank's, also empty
             item("scalar", (), (), (0, 1)),
             item("split", (4,), ((0, 2),), (0, 2)), item("split", (4,), ((2, 4),), (0, 2))]
    named = [k for it in items for k in reported_tensors([it])]
    assert sorted(named) == ["empty", "scalar", "split"]
