"""A traced step read back (watch/timeline.py): the per-stage summary, and the schedule replayed
with the trace's own durations against the traced span. Traces are made by train's own writer
(train/trace.py) from the schedule simulator, so their truth is known."""

import json
from types import SimpleNamespace

import pytest

from mscale.errors import MscaleError
from mscale.parallel.pipeline.schedule import simulate
from mscale.train.trace import chrome_trace, pack, rank_places
from mscale.watch.timeline import latest, load, replayed, stage_summary


def write_trace(path, stage_s, m=4, latency=0.0, step=3):
    pp = len(stage_s)
    per = [s / (3 * m) for s in stage_s]
    timeline = simulate(pp, 1, m, per, [2 * p for p in per], latency=latency)
    rows = {r: pack([("forward" if a.forward else "backward", a.micro, a.chunk, t0, t1)
                     for a, t0, t1 in timeline[r]], 64) for r in range(pp)}
    places = rank_places(SimpleNamespace(tp=1, pp=pp, dp=1), [f"node{i + 1}" for i in range(pp)],
                         lambda r: r)
    path.write_text(json.dumps(chrome_trace(rows, step, places)))
    return max(t[-1][2] for t in timeline)


def test_the_replay_of_a_trace_without_transfer_time_is_its_span(tmp_path):
    span = write_trace(tmp_path / "step-000003.json", [1.0, 3.0, 2.0])
    tl = load(str(tmp_path / "step-000003.json"))
    assert tl.step == 3 and tl.stage == {0: 0, 1: 1, 2: 2}
    measured, replay = replayed(tl)
    assert measured == pytest.approx(span) and replay == pytest.approx(span, rel=1e-6)
    rows = stage_summary(tl)
    assert [r["stage"] for r in rows] == [0, 1, 2]
    assert rows[1]["forward"] == pytest.approx(1.0) and rows[1]["backward"] == pytest.approx(2.0)


def test_transfer_time_shows_as_the_gap_between_span_and_replay(tmp_path):
    write_trace(tmp_path / "step-000003.json", [1.0, 1.0], latency=0.05)
    measured, replay = replayed(load(str(tmp_path / "step-000003.json")))
    assert measured > replay + 0.05


def test_the_newest_trace_is_found_and_a_foreign_file_is_refused(tmp_path):
    assert latest(str(tmp_path)) is None
    write_trace(tmp_path / "step-000003.json", [1.0, 1.0])
    write_trace(tmp_path / "step-000012.json", [1.0, 1.0], step=12)
    (tmp_path / "notes.json").write_text("{}")
    assert latest(str(tmp_path)).endswith("step-000012.json")
    with pytest.raises(MscaleError, match="not a timeline"):
        load(str(tmp_path / "notes.json"))


def test_the_report_shows_the_newest_traced_step(tmp_path):
    from mscale.watch.report import render

    from tests.unit.watch.pages import network_references

    write_trace(tmp_path / "step-000003.json", [1.0, 2.0])
    page = render("run", None, None, [], [], {}, 0, trace_url=str(tmp_path / "step-000003.json"))
    assert "<h2>Timeline</h2>" in page and "(step 3)" in page and "(100%)" in page
    assert network_references(page) == []  # the path is text, not a link


def test_a_damaged_trace_is_named_on_the_page_not_fatal(tmp_path):
    from mscale.watch.report import render

    (tmp_path / "step-000004.json").write_text('{"traceEvents": [')
    page = render("run", None, None, [], [], {}, 0, trace_url=str(tmp_path / "step-000004.json"))
    assert "<h2>Timeline</h2>" in page and "not a timeline written by mscale train" in page
