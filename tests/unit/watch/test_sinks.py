"""watch's outputs: the bounded history, --jsonl/--json, the Prometheus textfile, the
self-contained HTML report, and the plain view."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mscale.watch import report, sinks
from mscale.watch.findings import Finding
from mscale.watch.history import Binned, History
from mscale.watch.layout import JobLayout
from mscale.watch.view import Actions, PlainView, finding_line, sparkline
from mscale.watch.window import PER_RANK, SCALARS, Window

from tests.unit.watch.pages import network_references


def window(first: int, n: int, world: int, slow: int | None = None, loss=None) -> Window:
    steps = np.arange(first, first + n)
    ranks = np.zeros((n, len(PER_RANK), world))
    ranks[:, PER_RANK.index("step_time")] = 1.0
    ranks[:, PER_RANK.index("compute_time")] = 0.6
    ranks[:, PER_RANK.index("comm_wait")] = 0.3
    if slow is not None:
        ranks[:, PER_RANK.index("compute_time"), slow] = 0.9
        ranks[:, PER_RANK.index("comm_wait"), slow] = 0.0
    scalars = np.full((n, len(SCALARS)), np.nan)
    scalars[:, SCALARS.index("loss")] = loss if loss is not None else 10.0 / steps
    scalars[:, SCALARS.index("grad_norm")] = 1.0
    scalars[:, SCALARS.index("tokens_per_s")] = 5000.0
    return Window(steps, ranks, scalars, [{} for _ in range(n)])


def finding(**kw) -> Finding:
    base = dict(kind="straggler", severity="warning", message="rank 3 computes 50% longer",
                cause="slow_device", ranks=[3], nodes=["node1"], first_step=5, last_step=9,
                slowdown_pct=31.5, evidence={"compute_s": np.float64(0.9), "z": float("inf")},
                advice="replace node1")
    return Finding(**{**base, **kw})


def test_binned_keeps_memory_fixed_and_means_exact():
    b = Binned(dim=1, cols=4)
    for step in range(1, 21):
        b.add(step, np.array([float(step)]))
    assert b.sum.shape == (4, 1) and b.used <= 4 and b.width == 8
    # every step is in exactly one bin, in order, and each bin's mean is the mean of its steps
    assert b.count[: b.used].sum() == 20
    assert list(b.first[: b.used]) == [1, 9, 17] and list(b.steps()) == [8, 16, 20]
    assert list(b.means()[:, 0]) == [4.5, 12.5, 18.5]


def test_history_heat_and_curves_follow_the_records():
    h = History(world=4, rank_cols=4)
    for first in range(1, 40, 5):
        h.add(window(first, 5, 4, slow=3))
    steps, grid = h.heat("compute")
    assert grid.shape == (4, len(steps)) and len(steps) <= 4
    assert np.allclose(grid[3], 0.9) and np.allclose(grid[:3], 0.6)
    _, wait = h.heat("wait")
    assert np.allclose(wait[3], 0.0)
    assert h.latest["step"] == 40 and h.latest["step_time"] == 1.0
    s, loss = h.scalar("loss")
    assert s[-1] == 40 and len(loss) == len(s)


def test_jsonl_one_line_per_finding_nan_as_null():
    out = io.StringIO()
    sinks.write_jsonl(out, [finding(), finding(kind="nan", severity="critical")])
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["ranks"] == [3] and first["evidence"]["z"] is None
    assert first["evidence"]["compute_s"] == 0.9 and first["slowdown_pct"] == 31.5


def test_exit_code_is_the_worst_severity():
    assert sinks.exit_code([]) == 0
    assert sinks.exit_code([finding(severity="info")]) == 0
    assert sinks.exit_code([finding(), finding(severity="info")]) == 1
    assert sinks.exit_code([finding(), finding(severity="critical")]) == 2


def test_prometheus_textfile_parses_and_is_replaced_whole(tmp_path):
    h = History(world=4)
    h.add(window(1, 5, 4))
    text = sinks.prometheus_text("runs/r1", h, [finding()], [finding(), finding(kind="nan")],
                                 last_record_time=100.0, now=112.5)
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    value = {f: fams[f].samples[0].value for f in ("mscale_watch_step", "mscale_watch_severity",
                                                 "mscale_watch_last_record_age_seconds")}
    assert value == {"mscale_watch_step": 5, "mscale_watch_severity": 1,
                     "mscale_watch_last_record_age_seconds": 12.5}
    assert "mscale_watch_mfu" not in fams  # NaN (not in the records) is left out, not exported
    [slow] = fams["mscale_watch_finding_slowdown_percent"].samples
    assert slow.labels == {"run": "runs/r1", "kind": "straggler", "cause": "slow_device",
                           "ranks": "3", "nodes": "node1"} and slow.value == 31.5
    totals = {s.labels["kind"]: s.value for s in fams["mscale_watch_findings_total"].samples}
    assert totals == {"straggler": 1, "nan": 1}
    path = tmp_path / "watch.prom"
    path.write_text("old")
    sinks.write_prometheus(str(path), text)
    assert path.read_bytes() == text and [p.name for p in tmp_path.iterdir()] == ["watch.prom"]


def test_report_is_self_contained_with_figures_and_findings(tmp_path):
    layout = JobLayout.from_flags(tp=2, pp=1, dp=2, ranks_per_node=2, hostlist="gpu[1-2]")
    h = History(world=4)
    h.add(window(1, 30, 4, slow=3))
    f = finding(message="rank 3 <slow> & late")
    page = report.render("runs/r1", h, layout, [f], [{"action": "quarantine", "time": 1.0,
                                                      "nodes": ["gpu2"]}], {"worst": "warning"}, 1)
    assert network_references(page) == []
    assert "<script" not in page and "<link" not in page
    assert page.count("<svg") == 3  # curves, compute heat map, wait heat map
    assert "data:image/png;base64," in page  # the heat maps' raster, inlined
    assert "rank 3 &lt;slow&gt; &amp; late" in page and "<slow>" not in page
    assert "gpu1" in page and "gpu2" in page  # node labels at the node boundaries
    assert "quarantine" in page and "+31.5%" in page
    url = tmp_path / "r.html"
    report.write_report(str(url), page)
    assert url.read_text() == page
    assert network_references('<img src="http://x/a.png">') != []


def test_report_without_records_still_renders():
    page = report.render("x.jsonl", None, None, [], [], {}, 0)
    assert "No metrics records yet" in page and "healthy" in page


def test_plain_view_lines():
    out, t = io.StringIO(), [0.0]
    view = PlainView(out, status_every_s=30, clock=lambda: t[0])
    h = History(world=4)
    h.add(window(1, 5, 4))
    view.update(h, None, [finding()], [finding()])
    t[0] = 10.0
    view.update(h, None, [], [])  # no new finding, status not due: silent
    t[0] = 31.0
    view.update(h, None, [], [])
    lines = out.getvalue().splitlines()
    assert lines[0] == ("step 5 WARNING straggler/slow_device rank 3 (node1) +31.5%: "
                        "rank 3 computes 50% longer")
    assert lines[1] == "  advice: replace node1"  # once, under the finding
    assert re.match(r"step 5 \| loss 2 \| grad-norm 1 \| step-time 1s \| tokens/s 5,000 \| "
                    r"open alerts 1$", lines[2])
    assert len(lines) == 4 and lines[3].endswith("open alerts 0")


def test_plain_view_says_what_was_done_and_escalations():
    out = io.StringIO()
    view = PlainView(out, status_every_s=1e9)
    f = finding(cause="slow_link")
    view.update(None, None, [f], [f], actions=Actions(
        of={id(f): ["checkpoint requested (control/checkpoint)"]}))
    view.update(None, None, [], [f], actions=Actions(later=["node1 quarantined"]))
    f.severity, f.slowdown_pct, f.last_step = "critical", 196.5, 30
    view.update(None, None, [], [f])
    view.update(None, None, [], [f])  # said once
    assert out.getvalue().splitlines() == [
        "step 5 WARNING straggler/slow_link rank 3 (node1) +31.5%: rank 3 computes 50% longer",
        "  advice: replace node1",
        "  action: checkpoint requested (control/checkpoint)",
        "action: node1 quarantined",
        "escalated to CRITICAL at step 30: step 5 CRITICAL straggler/slow_link rank 3 (node1) "
        "+196.5%: rank 3 computes 50% longer"]


@pytest.mark.parametrize("values,expected", [([1, 2, 3], "▁▅█"), ([2, 2], "▁▁"), ([], "")])
def test_sparkline(values, expected):
    assert sparkline(np.array(values, float)) == expected


def test_finding_line_many_ranks():
    line = finding_line(finding(ranks=list(range(10)), nodes=["a", "b"], slowdown_pct=None))
    assert "ranks 0,1,2,3,4,5,+4 (a,b):" in line


def test_a_clean_finish_is_said_last_with_the_verdict_and_its_open_alerts():
    from mscale.watch.ending import JobEnd
    from mscale.watch.view import finished_line

    end = JobEnd(cause="finished", severity="ok", reason="", exit_code=0, step=30, attempt=2)
    assert finished_line(end, [], 0) == ("OK job finished at step 30 (attempt 2, exit 0); "
                                         "no open alerts")
    assert finished_line(end, [finding(), finding()], 1) == (
        "WARNING job finished at step 30 (attempt 2, exit 0); 2 open alerts (straggler)")
    bare = JobEnd(cause="finished", severity="ok", reason="", exit_code=None)
    assert finished_line(bare, [], 0) == "OK job finished; no open alerts"
    assert finished_line(end, [], 2) == ("CRITICAL job finished at step 30 (attempt 2, exit 0); "
                                         "no open alerts (exit 2: a critical finding earlier in "
                                         "the session)")


def test_rates_read_like_trains_console():
    from mscale.watch.view import _rate

    assert [_rate(v) for v in (613_912.4, 3375.2, 250.0, 3.254)] == [
        "613,912", "3,375", "250", "3.25"]
