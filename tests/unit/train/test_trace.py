"""Timelines of sampled steps (train/trace.py): what a traced step records, what an untraced one
costs, and the Chrome trace-event document Perfetto opens."""

import json
import math

import torch

from mscale.config.layout import LayoutConfig
from mscale.distributed.collectives import HostClock
from mscale.train import trace
from mscale.train.control import Control
from mscale.train.timers import StepTimer

from tests.unit.train.test_schedule_control import FakeNow


def traced_step(now: FakeNow) -> StepTimer:
    t = StepTimer(clock=HostClock(now))
    t.start_step(trace=True)
    with t.region("data"):
        now.sleep(0.01)
    with t.work("forward", 0):
        with t.region("bubble", link="pp"):
            now.sleep(0.02)
        now.sleep(0.05)
    with t.work("backward", 0):
        now.sleep(0.1)
    with t.region("comm_wait", link="dp"):
        now.sleep(0.03)
    t.end_step()
    return t


def test_a_traced_step_records_work_and_waits_from_its_start():
    t = traced_step(FakeNow())
    got = [(n, m, c, round(a, 6), round(b, 6)) for n, m, c, a, b in t.events]
    assert got == [("data", -1, -1, 0.0, 0.01), ("forward", 0, 0, 0.01, 0.08),
                   ("bubble", -1, -1, 0.01, 0.03), ("backward", 0, 0, 0.08, 0.18),
                   ("dp wait", -1, -1, 0.18, 0.21)]


def test_an_untraced_step_records_nothing_and_shares_one_no_op():
    now = FakeNow()
    t = StepTimer(clock=HostClock(now))
    t.start_step()
    assert t.work("forward", 0) is t.work("backward", 3)  # no per-call object
    with t.work("forward", 0):
        now.sleep(0.1)
    t.end_step()
    assert t.events is None and t._work == []


def test_pack_pads_with_nan_and_drops_what_does_not_fit():
    rows = trace.pack([("forward", 1, 0, 0.0, 1.0)] * 3, 2)
    assert rows.shape == (2, 5) and rows[1].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert math.isnan(trace.pack([], 4)[0, 0])


def test_replica_is_one_pipeline_and_all_is_every_rank():
    layout = LayoutConfig(tp=2, pp=2, dp=2)
    assert trace.traced_ranks(layout, "replica") == [0, 1, 4, 5]
    assert trace.traced_ranks(layout, "all") == list(range(8))


def test_the_document_is_valid_trace_event_format_one_track_per_rank():
    t = traced_step(FakeNow())
    layout = LayoutConfig(tp=2, pp=2, dp=2)
    places = trace.rank_places(layout, ["n1", "n2", "n3", "n4"], lambda r: r // 2)
    row = trace.pack(t.events, trace.events_limit(1, 1))
    doc = json.loads(trace.dumps(trace.chrome_trace({0: row, 5: row}, 7, places)))
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["ranks"] == [0, 5]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {"node n1",
                                                                               "node n3"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    assert threads == {(0, 0): "rank 0 · stage 0 · tp 0 · dp 0",
                       (2, 5): "rank 5 · stage 1 · tp 1 · dp 0"}
    for e in spans:  # the fields the trace-event format requires of a complete event
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
        assert isinstance(e["ts"], (int, float)) and (e["pid"], e["tid"]) in threads
    assert len(spans) == 2 * len(t.events)
    fwd = next(e for e in spans if e["name"] == "forward mb0" and e["tid"] == 5)
    assert fwd["ts"] == 10000.0 and fwd["dur"] == 70000.0  # microseconds


def test_a_trace_request_is_read_once(tmp_path):
    ctl = tmp_path / "control"
    ctl.mkdir()
    (ctl / "trace").write_text("")
    c = Control(str(ctl), rank=0)
    assert c.poll().trace and not c.poll().trace
    assert not torch.distributed.is_initialized()
