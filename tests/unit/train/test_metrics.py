"""What rank 0 writes into metrics.jsonl: version 1 lists for small worlds, compact version 2
from COMPACT_MIN_RANKS ranks on, both read back by watch to the same numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mscale.config.records import LINK_FIELDS, LINK_SCALE
from mscale.config.vectors import COMPACT_MIN_RANKS
from mscale.runs.rundir import RunDir
from mscale.train.metrics import FIELDS, build_record
from mscale.watch.stream import MetricsFeed, records_to_window
from mscale.watch.window import PER_RANK


def gathered(world: int, seed: int = 0) -> torch.Tensor:
    """A [world, len(FIELDS)] matrix as the gather returns it: timings of a noisy job."""
    g = torch.Generator().manual_seed(seed)
    v = torch.rand((world, len(FIELDS)), generator=g, dtype=torch.float64)
    v[:, FIELDS.index("loss_weight")] = (torch.arange(world) % 2).double()
    return v


def record(vectors: torch.Tensor):
    return build_record(vectors, step=7, grad_norm=1.5, clip_threshold=2.0, lr=1e-4, tokens=4096,
                        flops_per_step=1e15, peak_flops_per_device=1e14, extra={"gc": True})


@pytest.mark.parametrize("world, version", [(8, 1), (COMPACT_MIN_RANKS - 1, 1),
                                            (COMPACT_MIN_RANKS, 2), (12288, 2)])
def test_the_version_follows_the_world(world, version, tmp_path):
    vectors = gathered(world)
    run = RunDir(str(tmp_path))
    run.append_record(run.metrics, record(vectors))
    raw = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert raw["schema_version"] == version
    assert isinstance(raw["step_time"], list) == (version == 1)
    w = records_to_window(MetricsFeed(str(tmp_path)).poll())
    for name, col in zip(PER_RANK, ("step", "compute", "comm_wait", "data", "bubble",
                                    "comm_tp", "comm_pp", "comm_dp")):
        resolution = (LINK_SCALE if name in LINK_FIELDS else 1e-6) if version == 2 else 0
        np.testing.assert_allclose(w.per_rank(name)[0], vectors[:, FIELDS.index(col)].numpy(),
                                   rtol=0, atol=resolution / 2)


def test_version_2_is_several_times_smaller_at_12288_ranks():
    rec = record(gathered(12288))
    compact = len(rec.model_dump_json(exclude_none=True))
    plain = len(rec.model_copy(update={"schema_version": 1}).model_dump_json(exclude_none=True))
    assert plain > 3 * compact


def test_a_nan_loss_reads_back_as_nan_through_the_feed(tmp_path):
    vectors = gathered(4)
    vectors[:, FIELDS.index("loss")] = math.nan
    run = RunDir(str(tmp_path))
    run.append_record(run.metrics, record(vectors))
    assert math.isnan(records_to_window(MetricsFeed(str(tmp_path)).poll()).scalar("loss")[0])
