"""Resharding with the real engine: save at 2x2x2 (tp x pp x dp), load at 1x2x4, 4x1x2,
2x1x4 ZeRO-2, 2x2x2 ZeRO-0, 1x1x8 with hierarchical DP, 1x2x4 interleaved with block-less end
chunks, and back at 2x2x2, and at 1x1x1 in one process.

Every load must reproduce the saved model *and* optimizer state bit for bit (the state is moved,
never recomputed). The next step then matches the uninterrupted run: exactly at the saving layout,
within float tolerance at the others (a different layout sums in a different order). Offline
conversion to each layout must write exactly what the live engine saved there.
"""

from __future__ import annotations

import pytest
import torch

from mscale.ckpt import catalog, files
from mscale.ckpt.convert import reshard
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import RNG
from tests.distributed.ckpt_cases import assemble, chain, resume_once
from tests.distributed.engine_cases import make_plan
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist

START = dict(tp=2, pp=2, dp=2, zero=1, sp=True)
LAYOUTS = [dict(tp=1, pp=2, dp=4, zero=1, mb=1),
           dict(tp=4, pp=1, dp=2, zero=1, sp=True),
           dict(tp=2, pp=1, dp=4, zero=2),
           dict(tp=2, pp=2, dp=2, zero=0),
           dict(tp=1, pp=1, dp=8, zero=1, hier=True, mb=1),
           # interleaved, the first chunk only the embedding and the last only the head
           dict(tp=1, pp=2, dp=4, vpp=2, zero=1, mb=1, stage_layers=[0, 1, 1, 0]),
           START]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    per_rank = run_distributed(chain, 8, root, LAYOUTS, START, timeout_s=120)
    return root, per_rank


def _same(a: dict, b: dict, label: str) -> None:
    assert a["model"].keys() == b["model"].keys() and a["optim"].keys() == b["optim"].keys()
    for part in ("model", "optim"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), f"{label}: {part} {k} differs"


def _loss(per_rank: list[dict], key) -> float:
    vals = [key(r)[0] for r in per_rank if key(r)[0] is not None]
    return sum(vals) / len(vals)


def test_every_layout_loads_the_exact_state(run):
    _, per_rank = run
    saved = assemble([r["saved"] for r in per_rank])
    for i, layout in enumerate(LAYOUTS):
        loaded = assemble([r["layouts"][i]["loaded"] for r in per_rank])
        _same(saved, loaded, f"load at {layout}")
        assert all(r["layouts"][i]["loaded"]["step"] == 2 for r in per_rank)
        assert all(r["layouts"][i]["first"] == 2 for r in per_rank)
        clip = {str(r["layouts"][i]["loaded"]["clip"]) for r in per_rank}
        assert clip == {str(per_rank[0]["saved"]["clip"])}


def test_next_step_matches_the_uninterrupted_run(run):
    _, per_rank = run
    want = _loss(per_rank, lambda r: r["next_loss"])
    nxt = assemble([r["next"] for r in per_rank])
    for i, layout in enumerate(LAYOUTS):
        got = _loss(per_rank, lambda r: r["layouts"][i]["loss"])
        after = assemble([r["layouts"][i]["after"] for r in per_rank])
        if layout is START:  # back at the saving layout: bit-identical
            assert got == want
            _same(nxt, after, "back at 2x2x2")
            rng = [torch.equal(r["layouts"][i]["after"]["rng"], r["next"]["rng"])
                   for r in per_rank]
            assert all(rng)
        else:
            assert abs(got - want) < 1e-5 * abs(want), (layout, got, want)
            for k, v in nxt["model"].items():
                torch.testing.assert_close(after["model"][k], v, rtol=0, atol=1e-4)


def test_single_process_loads_the_2x2x2_checkpoint(run):
    root, per_rank = run
    (res,) = run_distributed(resume_once, 1, f"{root}/start/step-000002", dict(zero=1))
    saved = assemble([r["saved"] for r in per_rank])
    _same(saved, assemble([res["loaded"]]), "1x1x1")
    want = _loss(per_rank, lambda r: r["next_loss"])
    assert abs(res["loss"][0] - want) < 1e-5 * abs(want)


def test_commits_were_recorded(run):
    _, per_rank = run
    events = per_rank[0]["events"]
    assert [e["kind"] for e in events].count("checkpoint") == 1 + len(LAYOUTS)
    assert not [e for e in events if e["kind"] == "checkpoint_failed"]
    assert events[0]["evidence"]["shards"] == 8


def _slices(path: str, m) -> dict[int, set]:
    """Per rank the (tensor, box, flat range) it saved, RNG states aside (convert drops them)."""
    return {sh.rank: {(x.tensor, x.box_tuple(), tuple(x.flat))
                      for x in files.shard_slices(path, m, sh)
                      if not x.tensor.startswith(f"{RNG}.")} for sh in m.shards}


def test_convert_writes_what_the_live_engine_saved_at_each_layout(run, tmp_path):
    """The start checkpoint converted offline to each layout against the checkpoint the live
    engine saved right after loading at that layout (the same state, bit for bit): the same
    slices on the same ranks, holding the same bytes."""
    root, _ = run
    src = f"{root}/start/step-000002"
    for i, layout in enumerate(LAYOUTS):
        live_dir = f"{root}/l{i}/step-000002"
        live = catalog.load_committed(live_dir)
        conv = reshard(src, catalog.load_committed(src), str(tmp_path / f"c{i}"),
                       make_plan(layout), level=0)
        assert _slices(str(tmp_path / f"c{i}"), conv) == _slices(live_dir, live), layout
        with CheckpointReader(live_dir, live) as a, \
                CheckpointReader(str(tmp_path / f"c{i}"), conv) as b:
            for tensor, box, flat in set().union(*_slices(live_dir, live).values()):
                assert torch.equal(a.read(tensor, box, flat), b.read(tensor, box, flat)), \
                    (layout, tensor, box, flat)
