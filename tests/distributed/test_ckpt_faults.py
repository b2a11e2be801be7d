"""Checkpoint faults with the real engine on 2 gloo processes: a shard whose fsync fails is never
committed (the save fails, `latest` stays), and a rank that never reaches the commit fails the
job within the job's timeout, while one whose write is only slow keeps the others waiting past
it; a shard index damaged after the commit, which only one rank reads at resume, stops both ranks
with the same message."""

from __future__ import annotations

import pytest

from tests.distributed.ckpt_cases import (commit_never_reached, fsync_fails, resume_outcome,
                                          save_at_two, slow_write_outlasts_the_timeout)
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist

CASE = dict(dp=2, zero=1)


def test_a_failed_fsync_fails_the_save_and_latest_stays(tmp_path):
    per_rank = run_distributed(fsync_fails, 2, str(tmp_path), CASE)
    events = per_rank[0]["events"]
    assert [(e["kind"], e["step"]) for e in events] == [("checkpoint", 2),
                                                       ("checkpoint_failed", 3)]
    failed = events[1]
    assert failed["ranks"] == [1] and "Input/output error" in failed["evidence"]["errors"]["1"]
    assert failed["evidence"]["latest"] == "step-000002"
    assert per_rank[0]["latest"] == "step-000002" and per_rank[0]["dirs"] == ["step-000002"]


def test_a_rank_that_never_commits_fails_the_job_within_the_timeout(tmp_path):
    timeout_s = 3.0
    # without the job's timeout on the commit group, rank 0 waits gloo's 30 minutes and the
    # harness gives up after 2 * 20 + 30 s
    per_rank = run_distributed(commit_never_reached, 2, str(tmp_path), CASE, timeout_s,
                               timeout_s=20)
    got = per_rank[0]
    assert got["error"] is not None and "timed out" in got["error"].lower(), got
    # the job's timeout fired (gloo names it in ms), not gloo's 30-minute default; no upper
    # wall-clock bound: the harness's own timeout stops a job that waits longer
    assert "3000ms" in got["error"] and got["elapsed"] >= timeout_s * 0.8, got


def test_a_write_slower_than_the_timeout_on_one_rank_is_waited_for(tmp_path):
    """The ranks poll each other while one still writes, so the quick rank never sits in a
    collective for the slow write's length; rank 0 says the wait goes on every timeout."""
    per_rank = run_distributed(slow_write_outlasts_the_timeout, 2, str(tmp_path), CASE, 1.5,
                               4.0, timeout_s=60)
    events = per_rank[0]["events"]
    assert per_rank[0]["latest"] == "step-000001", events
    waits = [e for e in events if e["kind"] == "info"]
    assert waits and all(e["evidence"]["still_writing"] == 1 for e in waits), events
    assert "1 rank(s) still writing after" in waits[0]["message"]
    assert [e["kind"] for e in events][-1] == "checkpoint"


def test_an_index_only_one_rank_reads_stops_every_rank_alike(tmp_path):
    """At the layout that saved, rank 1 alone reads rank-00001.index.json: its failure must be
    agreed on before any collective, not leave rank 0 in one."""
    run_distributed(save_at_two, 2, str(tmp_path), CASE)
    ckpt = tmp_path / "ckpt" / "step-000002"
    index = ckpt / "rank-00001.index.json"
    data = bytearray(index.read_bytes())
    data[-2] = ord("]") if data[-2] != ord("]") else ord("}")  # same size, another sha256
    index.write_bytes(bytes(data))
    per_rank = run_distributed(resume_outcome, 2, str(ckpt), CASE, timeout_s=60)
    assert per_rank[0] == per_rank[1], per_rank
    assert per_rank[0]["code"] == 3 and per_rank[0]["file"].endswith("rank-00001.index.json")
    assert "sha256" in per_rank[0]["message"]
