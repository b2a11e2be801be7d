"""`JsonlTail` as `watch` reads events.jsonl through it (follow.py `EventFeed`): only what was
appended since the last poll, locally and on ``memory://`` (an object store: one segment object
per appended record); a replaced file is read again from its start. MetricsFeed's own cases
(torn tails, attempts, max_bytes) are in test_stream.py."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from mscale.errors import MscaleError
from mscale.runs.atomic import append_line
from mscale.watch.follow import EventFeed


def event(n: int) -> str:
    return json.dumps({"kind": "checkpoint", "step": n, "message": f"saved step {n}"})


@pytest.fixture(params=["local", "memory"])
def events(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "events.jsonl")
        return
    url = f"memory://tail-{uuid.uuid4().hex[:8]}/run/events.jsonl"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.rsplit("/", 1)[0]
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_an_event_feed_returns_each_event_once(events):
    feed = EventFeed(events)
    assert feed.poll() == []  # not written yet: nothing, no error
    for n in (1, 2):
        append_line(events, event(n))
    assert [e["step"] for e in feed.poll()] == [1, 2]
    assert feed.poll() == []
    append_line(events, event(3))
    assert [e["step"] for e in feed.poll()] == [3]


def test_an_event_feed_fetches_only_new_events_from_an_object_store():
    """Each poll used to GET every event object ever written; now only the new ones."""
    url = f"memory://tail-{uuid.uuid4().hex[:8]}/run/events.jsonl"
    feed = EventFeed(url)
    for n in range(1, 21):
        append_line(url, event(n))
    assert len(feed.poll()) == 20
    fetched: list[str] = []
    fs = feed.tail.fs
    cat, cat_file = fs.cat, fs.cat_file
    fs.cat = lambda paths: fetched.extend(paths) or cat(paths)
    fs.cat_file = lambda path, **kw: fetched.append(path) or cat_file(path, **kw)
    append_line(url, event(21))
    assert [e["step"] for e in feed.poll()] == [21] and len(set(fetched)) == 1
    assert feed.poll() == [] and len(set(fetched)) == 1
    fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def test_a_replaced_events_file_is_read_from_its_start(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text("".join(event(n) + "\n" for n in (1, 2, 3)))
    feed = EventFeed(str(path))
    assert len(feed.poll()) == 3
    path.write_text(event(7) + "\n")  # shorter: another file
    assert [e["step"] for e in feed.poll()] == [7]


def test_a_torn_last_event_waits_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(event(1) + "\n" + event(2)[:20])
    feed = EventFeed(str(path))
    assert [e["step"] for e in feed.poll()] == [1]
    path.write_text(event(1) + "\n" + event(2) + "\n" + "not json\n")
    with pytest.raises(MscaleError) as e:
        feed.poll()
    assert e.value.file == str(path) and "line 3" in e.value.message
