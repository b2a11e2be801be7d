"""Following metrics.jsonl live (MetricsFeed) and decoding records to a Window, on a local
directory and on ``memory://`` (an object store: one segment object per appended record)."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import numpy as np
import pytest

from mscale.config.vectors import encode_vector
from mscale.errors import MscaleError
from mscale.runs.atomic import append_line
from mscale.watch.stream import MetricsFeed, decode_record, metrics_url, records_to_window
from mscale.watch.window import PER_RANK, SCALARS

WORLD = 4


def rec(n: int, world: int = WORLD, **more) -> dict:
    base = [1.0 + 0.01 * r for r in range(world)]
    out = {"schema_version": 1, "step": n, "time": 1000.0 + n, "loss": 2.0 / n,
           "step_time": base, "compute_time": [0.5] * world, "comm_wait": [0.3] * world,
           "data_time": [0.1] * world, "bubble_time": [0.05] * world}
    return {**out, **more}


def line(n: int, **more) -> bytes:
    return (json.dumps(rec(n, **more)) + "\n").encode()


@pytest.fixture(params=["local", "memory"])
def run(request, tmp_path):
    """A run directory URL; memory:// ones are removed afterwards (one global store)."""
    if request.param == "local":
        yield str(tmp_path / "run")
        return
    url = f"memory://watch-{uuid.uuid4().hex[:8]}/run"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def put(url: str, data: bytes) -> None:
    """Write the whole metrics file (what a local writer leaves, or an older run's whole file)."""
    fs, path = fsspec.core.url_to_fs(f"{url}/metrics.jsonl")
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    fs.pipe_file(path, data)


def steps(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def test_metrics_url_takes_a_run_directory_or_a_jsonl_file():
    assert metrics_url("runs/r1/") == "runs/r1/metrics.jsonl"
    assert metrics_url("s3://b/r1") == "s3://b/r1/metrics.jsonl"
    assert metrics_url("other/trainer.jsonl") == "other/trainer.jsonl"


def test_appended_records_arrive_once_in_order(run):
    feed = MetricsFeed(run)
    assert feed.poll() == [] and not feed.found  # nothing written yet is not an error
    for s in (1, 2):
        append_line(f"{run}/metrics.jsonl", json.dumps(rec(s)))
    assert steps(feed.poll()) == [1, 2] and feed.found and not feed.restarted
    assert feed.poll() == []
    append_line(f"{run}/metrics.jsonl", json.dumps(rec(3)))
    assert steps(feed.poll()) == [3] and feed.caught_up


def test_a_poll_reads_only_the_bytes_appended_since_the_last(run):
    put(run, line(1) + line(2))
    feed = MetricsFeed(run)
    feed.poll()
    reads = []
    cat_file = feed.tail.fs.cat_file
    feed.tail.fs.cat_file = lambda path, start=None, end=None: (
        reads.append((start, end)) or cat_file(path, start=start, end=end))
    put(run, line(1) + line(2) + line(3))
    assert steps(feed.poll()) == [3]
    body = (start for start, end in reads if end != start and start)
    assert list(body) == [len(line(1) + line(2))]  # besides the first bytes' fingerprint


def test_the_segments_of_an_object_store_are_read_only_once():
    url = f"memory://watch-{uuid.uuid4().hex[:8]}/run"
    feed = MetricsFeed(url)
    for s in (1, 2):
        append_line(f"{url}/metrics.jsonl", json.dumps(rec(s)))
    assert steps(feed.poll()) == [1, 2]
    fetched = []
    cat = feed.tail.fs.cat
    feed.tail.fs.cat = lambda paths: fetched.extend(paths) or cat(paths)
    append_line(f"{url}/metrics.jsonl", json.dumps(rec(3)))
    assert steps(feed.poll()) == [3] and len(fetched) == 1
    fsspec.filesystem("memory").rm(url, recursive=True)


def test_a_torn_last_line_waits_for_the_next_poll(run):
    whole = line(1) + line(2)
    put(run, whole + line(3)[:25])
    feed = MetricsFeed(run)
    assert steps(feed.poll()) == [1, 2]
    assert feed.poll() == []
    put(run, whole + line(3))
    assert steps(feed.poll()) == [3] and not feed.restarted


def test_a_last_record_that_lacks_only_its_newline_is_taken(run):
    put(run, line(1) + line(2)[:-1])
    feed = MetricsFeed(run)
    assert steps(feed.poll()) == [1, 2]
    put(run, line(1) + line(2) + line(3))  # the newline arrives with the next record
    assert steps(feed.poll()) == [3] and not feed.restarted


def test_a_briefly_missing_file_is_not_an_error(run):
    put(run, line(1))
    feed = MetricsFeed(run)
    assert steps(feed.poll()) == [1]
    fs, path = fsspec.core.url_to_fs(f"{run}/metrics.jsonl")
    fs.mv(path, path + ".moved")
    assert feed.poll() == [] and not feed.found
    fs.mv(path + ".moved", path)
    put(run, line(1) + line(2))
    assert steps(feed.poll()) == [2] and not feed.restarted


@pytest.mark.parametrize("new", [b"", line(1, time=5.0) + line(2, time=6.0) + line(3)],
                         ids=["shrank", "same-length-or-longer"])
def test_a_job_restarted_into_a_new_file_is_followed(run, new):
    put(run, line(1) + line(2))
    feed = MetricsFeed(run)
    feed.poll()
    put(run, new or line(1, time=9.0))  # truncated and rewritten; or a longer, other file
    got = feed.poll()
    assert feed.restarted and steps(got) == ([1] if not new else [1, 2, 3])
    put(run, (new or line(1, time=9.0)) + line(4))
    assert steps(feed.poll()) == [4] and not feed.restarted


def test_a_replaced_local_file_with_the_same_first_bytes_is_caught_by_its_inode(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line(1))
    feed = MetricsFeed(str(path))
    feed.poll()
    other = tmp_path / "new.jsonl"
    other.write_bytes(line(1) + line(2))
    os.replace(other, path)  # same first record, a new file: a job that started over
    assert steps(feed.poll()) == [1, 2] and feed.restarted


def test_a_resumed_job_rewriting_earlier_steps_starts_a_new_attempt(run):
    for s in (1, 2, 3, 2, 3):  # resumed from the checkpoint of step 1
        append_line(f"{run}/metrics.jsonl", json.dumps(rec(s)))
    feed = MetricsFeed(run)
    assert steps(feed.poll()) == [1, 2, 3] and not feed.restarted and not feed.caught_up
    assert steps(feed.poll()) == [2, 3] and feed.restarted and feed.caught_up
    append_line(f"{run}/metrics.jsonl", json.dumps(rec(1)))  # and again, between two polls
    assert steps(feed.poll()) == [1] and feed.restarted


def test_a_re_planned_job_that_lost_no_step_starts_a_new_attempt_at_its_new_world(run):
    """supervise's straggler repair: checkpoint at step 3, quarantine, resume on fewer ranks at
    step 4. No step goes back; the world does (a reader that missed it refused the run)."""
    for s, world in ((1, 8), (2, 8), (3, 8), (4, 6), (5, 6)):
        append_line(f"{run}/metrics.jsonl", json.dumps(rec(s, world=world)))
    feed = MetricsFeed(run)
    assert steps(feed.poll()) == [1, 2, 3] and not feed.restarted
    assert steps(feed.poll()) == [4, 5] and feed.restarted
    append_line(f"{run}/metrics.jsonl", json.dumps(rec(6, world=6)))
    assert steps(feed.poll()) == [6] and not feed.restarted
    encoded = rec(7, world=4)  # schema 2: the width is the decoded vector's
    encoded["step_time"] = encode_vector(encoded["step_time"])
    append_line(f"{run}/metrics.jsonl", json.dumps(encoded))
    assert steps(feed.poll()) == [7] and feed.restarted


def test_a_replaced_segment_directory_is_a_restart():
    url = f"memory://watch-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    feed = MetricsFeed(url)
    for s in (1, 2, 3):
        append_line(f"{url}/metrics.jsonl", json.dumps(rec(s)))
    feed.poll()
    fs.rm(url, recursive=True)
    for s in (5, 6):  # another job, larger step numbers: only the listing shows the change
        append_line(f"{url}/metrics.jsonl", json.dumps(rec(s)))
    assert steps(feed.poll()) == [5, 6] and feed.restarted
    fs.rm(url, recursive=True)


def test_a_poll_reads_about_max_bytes_and_says_it_is_behind(run):
    put(run, b"".join(line(s, loss=1.0, time=1.0) for s in range(1, 10)))  # equal lengths
    feed = MetricsFeed(run, max_bytes=len(line(1, loss=1.0, time=1.0)) * 3 + 1)
    got, polls = [], 0
    while True:
        got += feed.poll()
        polls += 1
        if feed.caught_up:
            break
    assert steps(got) == list(range(1, 10)) and polls == 3


def test_a_line_longer_than_max_bytes_still_arrives(run):
    put(run, line(1) + line(2))
    feed = MetricsFeed(run, max_bytes=10)
    assert steps(feed.poll()) == [1] and not feed.caught_up
    assert steps(feed.poll()) == [2] and feed.caught_up


def test_last_record_time_is_when_a_record_was_last_read(run):
    now = [100.0]
    feed = MetricsFeed(run, clock=lambda: now[0])
    feed.poll()
    assert feed.last_record_time is None
    put(run, line(1))
    feed.poll()
    now[0] = 130.0
    feed.poll()
    assert feed.last_record_time == 100.0
    put(run, line(1) + line(2, time=5.0))  # once live, the writer's clock is not trusted
    feed.poll()
    assert feed.last_record_time == 130.0


def test_records_found_on_the_first_read_count_from_when_they_were_written(run):
    """`watch --once` on a job that stopped writing an hour ago must see that hour."""
    put(run, line(1, time=40.0) + line(2, time=50.0))
    feed = MetricsFeed(run, clock=lambda: 3650.0)
    feed.poll()
    assert feed.last_record_time == 50.0
    put(run, line(1, time=9000.0))  # a writer's clock ahead of ours: never a time to come
    ahead = MetricsFeed(run, clock=lambda: 3650.0)
    ahead.poll()
    assert ahead.last_record_time == 3650.0


@pytest.mark.parametrize("data, says", [
    (line(1) + b"{nonsense\n" + line(3), "line 2 is not a JSON object"),
    (b"[1, 2]\n", "line 1 is not a JSON object"),
    (line(1, step="2"), "no integer step"),
])
def test_a_corrupt_record_is_a_named_error(run, data, says):
    put(run, data)
    with pytest.raises(MscaleError, match=says) as e:
        MetricsFeed(run).poll()
    assert e.value.file.endswith("metrics.jsonl")


def v2(r: dict) -> dict:
    return {**r, "schema_version": 2, **{k: encode_vector(r[k]) for k in PER_RANK if k in r}}


def test_window_from_version_1_and_2_records_agrees():
    records = [rec(1), rec(2, loss=None), rec(3, extra={"checkpoint": True})]
    for rs in (records, [v2(r) for r in records]):
        w = records_to_window(rs)
        assert w.steps.tolist() == [1, 2, 3] and w.ranks.shape == (3, len(PER_RANK), WORLD)
        np.testing.assert_allclose(w.per_rank("step_time")[2], rec(3)["step_time"], atol=1e-6)
        np.testing.assert_allclose(w.per_rank("bubble_time"), 0.05, atol=1e-6)
        assert np.isnan(w.scalar("loss")[1]) and np.isnan(w.scalar("mfu")).all()
        assert w.scalar("time").tolist() == [1001.0, 1002.0, 1003.0]
        assert w.extra == [{}, {}, {"checkpoint": True}]
    assert records_to_window([]).ranks.shape == (0, len(PER_RANK), 0)


def test_window_fills_only_the_optional_parts():
    """Another trainer's minimum: step and four vectors; bubble 0, scalars NaN, null NaN."""
    minimal = {"step": 7, "step_time": [1.0, None], "compute_time": [0.5, 0.5],
               "comm_wait": [0.5, 0.5], "data_time": [0.0, 0.0]}
    w = records_to_window([minimal])
    assert np.isnan(w.per_rank("step_time")[0, 1])
    assert (w.per_rank("bubble_time") == 0).all() and np.isnan(w.scalars).all()
    assert w.scalars.shape == (1, len(SCALARS))


@pytest.mark.parametrize("bad, says, field", [
    ({"comm_wait": None}, "lacks comm_wait", "comm_wait"),
    ({"data_time": [0.1] * (WORLD + 1)}, "has 5 ranks, the job has 4", "data_time"),
    ({"compute_time": "fast"}, "not a list of numbers", "compute_time"),
    ({"loss": "low"}, "must be a number", "loss"),
    ({"schema_version": 3}, "schema_version 3", "schema_version"),
    ({"step": 1.5}, "step must be an integer", "step"),
])
def test_window_refuses_a_bad_record_by_field(bad, says, field):
    with pytest.raises(MscaleError, match=says) as e:
        records_to_window([rec(1), rec(2, **bad)])
    assert e.value.field == field


def test_decode_record_gives_version_1_lists():
    r = decode_record(v2(rec(4)))
    assert isinstance(r["comm_wait"], list) and r["comm_wait"] == pytest.approx([0.3] * WORLD)
    assert decode_record(rec(4)) == rec(4)
