"""The flight recorder on real gloo groups: the dumps `train` writes when a rank fails
(`mscale.distributed.flight`) name the rank the others waited for (`recover/diagnose/flight.py`),
in the two shapes a stopped rank leaves: it never came back (no dump of its own, its peers
blocked in a cascade behind it), or it came back after its peers' timeout (SLURM's SIGCONT
before SIGTERM) and joined the collective they had given up on."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest

from mscale.recover.diagnose.flight import culprits
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist

TIMEOUT_S = 2.0


def _dumps(out: Path) -> dict[int, dict]:
    return {int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text())
            for p in out.glob("flight_recorder_rank*.json")}


def late_joiner(rank: int, world: int, out: str) -> str:
    """Every rank all-reduces in one group; rank 1 arrives after the others' timeout."""
    import torch
    import torch.distributed as dist

    from mscale.distributed import flight

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    dist.all_reduce(torch.ones(4), group=group)  # one that completes everywhere
    if rank == 1:
        time.sleep(2 * TIMEOUT_S)
    try:
        dist.all_reduce(torch.ones(4), group=group)
        return "completed"
    except RuntimeError:
        flight.write_dump(out, rank)
        return "failed"


def cascade(rank: int, world: int, out: str) -> str:
    """Groups A = [0, 1] and B = [1, 2]: rank 0 stops before A's collective and is never seen
    again (it writes no dump); rank 1 waits in A, so rank 2 waits in B for rank 1."""
    import torch
    import torch.distributed as dist

    from mscale.distributed import flight

    timeout = timedelta(seconds=TIMEOUT_S)
    a = dist.new_group([0, 1], timeout=timeout)
    b = dist.new_group([1, 2], timeout=timeout)
    if rank == 0:
        time.sleep(2 * TIMEOUT_S)
        return "stopped"
    try:
        dist.all_reduce(torch.ones(4), group=a if rank == 1 else b)
        if rank == 1:
            dist.all_reduce(torch.ones(4), group=b)
        return "completed"
    except RuntimeError:
        flight.write_dump(out, rank)
        return "failed"


@pytest.fixture
def recorder(monkeypatch):
    from mscale.distributed import flight

    monkeypatch.delenv(flight.LEGACY_BUFFER_ENV, raising=False)
    monkeypatch.setenv(flight.BUFFER_ENV, str(flight.DEFAULT_ENTRIES))


def test_a_rank_that_joined_after_its_peers_timeout_is_named(recorder, tmp_path):
    results = run_distributed(late_joiner, 3, str(tmp_path), timeout_s=30)
    assert results == ["failed"] * 3, results
    dumps = _dumps(tmp_path)
    assert sorted(dumps) == [0, 1, 2]
    assert culprits(dumps) == [1]


def test_the_rank_a_cascade_waits_for_is_named_not_the_rank_stuck_behind_it(recorder, tmp_path):
    results = run_distributed(cascade, 3, str(tmp_path), timeout_s=30)
    assert results == ["stopped", "failed", "failed"], results
    dumps = _dumps(tmp_path)
    assert sorted(dumps) == [1, 2]
    assert culprits(dumps) == [0]  # rank 1 is behind in B, but it waited for rank 0 in A
