"""Layout invariance on real data: blended, shuffled token datasets read from disk give every
layout the same global batches, so its losses, held-out loss and parameters match a single
process's (the engine numerics of test_engine_numerics.py, on the data path of docs/data.md).

Two sources, written as users' data is: a Megatron-LM indexed dataset (documents of random
lengths) and a flat nanoGPT-style token file; blended 3:1, shuffled, with a tenth of each held
out at a document boundary.
"""

import numpy as np
import pytest
import torch

from mscale.data.indexed import IndexedWriter
from tests.distributed.engine_cases import merge_params, reported_losses, run_cases
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist

STEPS = 3
MODEL = {"layers": 4}
LAYOUTS = [dict(tp=2, dp=2, sp=True, zero=2), dict(pp=2, dp=2, vpp=2, zero=1)]


@pytest.fixture(scope="module")
def data_config(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(5)
    # a learnable stream: each token mostly follows from the one before
    successor = rng.permutation(256)

    def document(n: int) -> np.ndarray:
        out = [int(rng.integers(256))]
        for _ in range(n - 1):
            out.append(int(successor[out[-1]]) if rng.random() < 0.8 else int(rng.integers(256)))
        return np.array(out)

    with IndexedWriter(str(root / "books"), np.uint16) as w:
        for _ in range(120):
            w.add_document(document(int(rng.integers(20, 90))))
    np.concatenate([document(500) for _ in range(6)]).astype(np.uint16).tofile(root / "web.bin")
    return {"sources": [{"path": str(root / "books"), "weight": 3.0},
                        {"path": str(root / "web.bin"), "weight": 1.0}],
            "dtype": "uint16", "eval_fraction": 0.1}


def _case(data: dict, **layout) -> dict:
    return {**layout, "model": MODEL,
            "training": {"data": data, "eval": {"interval": STEPS, "batches": 2}}}


def test_blended_shuffled_data_matches_a_single_process_at_every_layout(data_config):
    ref = run_distributed(run_cases, 1, [_case(data_config)], STEPS)[0][0]
    assert ref["losses"][-1] < ref["losses"][0] and np.isfinite(ref["eval_loss"])
    per_rank = run_distributed(run_cases, 4, [_case(data_config, **lay) for lay in LAYOUTS],
                               STEPS, timeout_s=90)
    for i, layout in enumerate(LAYOUTS):
        results = [r[i] for r in per_rank]
        label = str(layout)
        torch.testing.assert_close(torch.tensor(reported_losses(results)),
                                   torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{label} loss: {m}")
        for r in results:  # every rank ends with the same held-out loss
            assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), label
        params = merge_params(results)
        for name, want in ref["params"].items():
            torch.testing.assert_close(params[name], want, rtol=0, atol=1e-4,
                                       msg=lambda m: f"{label} {name}: {m}")


def _sees(rank: int, world: int, folder: str) -> str:
    """Rank 1 reads one more document than rank 0 (a node's copy that differs)."""
    from mscale.config.training import DataConfig
    from mscale.errors import MscaleError
    from mscale.train.data import check_same_data_everywhere, make_source

    src = make_source(DataConfig(path=f"{folder}/r{rank}"), 0, 8, 256)
    try:
        check_same_data_everywhere(src)
    except MscaleError as e:
        return e.message
    return "agreed"


def test_ranks_that_see_different_data_stop_before_a_step(tmp_path):
    """Each rank opens the files itself: node-local copies that differ gave the ranks different
    samples at one index, without an error."""
    for rank, docs in ((0, 6), (1, 7)):
        with IndexedWriter(str(tmp_path / f"r{rank}" / "shard-00000"), np.uint16) as w:
            for _ in range(docs):
                w.add_document(np.arange(1, 41) % 200)
    said = run_distributed(_sees, 2, str(tmp_path))
    assert said[0] == said[1] and said[0].startswith("the ranks see different data: token "
                                                      "counts 240 to 280, document counts 6 to 7")
