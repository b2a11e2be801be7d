"""preflight/report.py's Prometheus textfile: rendered by prometheus-client, so any label value
(a node or storage URL with quotes, backslashes, a newline) reads back as it was written."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.preflight.report import prometheus_text

ODD = 'mem://a"b\\c\nd'


def test_textfile_round_trips_every_label_and_keeps_the_metric_names():
    report = PreflightReport(world=2, status="CRITICAL", results=[
        CheckResult(check="storage", entity_kind="storage", entity=ODD, node=None,
                    value=12.5, unit='MB/"s', status="CRITICAL"),
        CheckResult(check="gemm", entity_kind="rank", entity="rank 1", node="node1",
                    status="OK")])
    text = prometheus_text(report).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples == {
        ("mscale_preflight_status", (("check", "storage"), ("entity", ODD), ("node", ""))): 2,
        ("mscale_preflight_status", (("check", "gemm"), ("entity", "rank 1"),
                                     ("node", "node1"))): 0,
        ("mscale_preflight_value", (("check", "storage"), ("entity", ODD), ("node", ""),
                                    ("unit", 'MB/"s'))): 12.5,
        ("mscale_preflight_job_status", ()): 2}
    assert 'entity="mem://a\\"b\\\\c\\nd"' in text  # escaped, one line per sample


def test_the_slow_links_blamed_on_one_node_share_one_line_and_the_report_keeps_them_all(
        tmp_path):
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.preflight.report import assemble
    from mscale.preflight.table import failure_lines

    from tests.unit.preflight.test_judge import _opts, _payloads

    plan = load_model(Plan, "plans/cpu-tiny.yaml")
    report = assemble(plan, _opts(tmp_path), _payloads(5))
    links = [r for r in report.results if r.status == "CRITICAL" and r.node == "node3"
             and r.entity_kind in ("pair", "group")]
    assert len(links) > 5  # every one of them stays in the report
    lines = failure_lines(report.results)
    node3 = [line for line in lines if "node3 is at fault" in line]
    assert len(node3) == 1, lines
    assert f"({len(links)} links" in node3[0]
    for r in links:
        assert r.entity in node3[0]
    # a device's own failure keeps its own line, with its message
    assert any(line.startswith("CRITICAL: gemm rank 5 (node3): ") for line in lines), lines
    # one slow link alone keeps its own line
    one = [r.model_copy() for r in links[:1]]
    assert failure_lines(one) == [f"CRITICAL: {one[0].check} {one[0].entity} (node3): "
                                  f"{one[0].message}"]


def test_progress_lines_are_throttled_and_say_how_far_and_the_slowest_so_far():
    import io

    from mscale.preflight.progress import LinkProgress, Ticker

    clock = [0.0]
    out = io.StringIO()
    ticker = Ticker(every_s=5.0, out=out, clock=lambda: clock[0])
    progress = LinkProgress("p2p", "pairs", 24, ticker, passes=2)  # 12 pairs, 2 passes
    clock[0] = 1.0
    progress.add([("tp pair 0<->1 on node1", 2.0, "GB/s", False)])
    assert out.getvalue() == ""  # within the interval
    clock[0] = 6.0
    progress.add([("dp pair 4<->6 on node3<->node4", 0.004, "GB/s", True)])
    assert out.getvalue() == ("preflight p2p: pass 1/2, 2/12 pairs, slowest so far dp pair "
                              "4<->6 on node3<->node4 0.004 GB/s, 1 test(s) cut short (far "
                              "below their peers) (at 6.0 s)\n")
    ticker.line("preflight [4/5] collectives")  # a phase line: always, and resets the interval
    clock[0] = 10.0
    progress.add([("tp pair 2<->3 on node2", 2.0, "GB/s", False)])
    assert out.getvalue().count("\n") == 2
    progress.finish()  # 9 s since it started: a last line
    assert out.getvalue().splitlines()[-1].startswith("preflight p2p: pass 1/2, 3/12 pairs")
    assert LinkProgress("x", "pairs", 1, None).add([("a", 1.0, "GB/s", False)]) is None


def test_progress_counts_pairs_per_pass_and_says_the_end_once():
    """`6/24 pairs` read as 24 pairs where the plan had 12 measured twice (a re-check of 3
    groups said `6/6 groups`), and a phase whose last item came as a line was due said the
    same line twice, the second time with `- done`."""
    import io

    from mscale.preflight.progress import LinkProgress, Ticker

    clock = [0.0]
    out = io.StringIO()
    progress = LinkProgress("recheck collectives", "groups", 6, Ticker(5.0, out, lambda: clock[0]),
                            passes=2)
    for t, figures in ((6.0, 3), (12.0, 1), (18.0, 2)):  # end of pass 1; pass 2; the last two
        clock[0] = t
        progress.add([("g", 1.0, "GB/s", False)] * figures)
    progress.finish()
    assert [line.split(" groups")[0] for line in out.getvalue().splitlines()] == [
        "preflight recheck collectives: pass 1/2, 3/3",
        "preflight recheck collectives: pass 2/2, 1/3",
        "preflight recheck collectives: pass 2/2, 3/3"]
    assert out.getvalue().splitlines()[-1].endswith("- done (at 18.0 s)")
    assert LinkProgress("p2p", "pairs", 5, None).text() == "preflight p2p: 0/5 pairs"


def test_past_a_small_job_the_ok_results_are_counted_not_listed():
    """12,288 ranks give tens of thousands of OK results: listed, they buried the failures in
    a batch log. A small job's table lists every result, as before."""
    from mscale.config.preflight import CheckResult
    from mscale.preflight.table import SHOWN_OK, table_rows

    def result(check, i, status="OK"):
        return CheckResult(check=check, entity=f"e{i}", entity_kind="rank", status=status,
                           node="node1", ranks=[i], value=1.0, unit="x", expected="-",
                           message="m")

    small = [result("gemm", i) for i in range(SHOWN_OK)] + [result("p2p", 0, "CRITICAL")]
    shown, folded = table_rows(small)
    assert len(shown) == len(small) and shown[0].status == "CRITICAL" and folded == ""
    big = [result("gemm", i) for i in range(12288)] + [result("p2p", i) for i in range(90)]
    big.append(result("p2p", 7, "WARNING"))
    shown, folded = table_rows(big)
    assert [r.status for r in shown] == ["WARNING"]
    assert folded == ("OK: 12,378 results not listed (gemm 12,288, p2p 90); --json and "
                      "preflight.json keep every one")


def test_a_healthy_report_past_the_listed_ok_results_prints_no_empty_table(capsys):
    """The CPU demo's preflight (world 8) already has 76 OK results: past SHOWN_OK the table
    listed nothing and printed an empty frame of headers. With nothing to list, the title
    says so on one line and the count line follows. Off a terminal no sentence is cut at 200
    columns (a batch log's grep for a line's end missed it)."""
    from mscale.config.preflight import CheckResult, PreflightReport
    from mscale.preflight.table import SHOWN_OK, render

    results = [CheckResult(check="gemm", entity=f"rank{i}", entity_kind="rank", status="OK",
                           node="node1", ranks=[i], value=1.0, unit="x", expected="-",
                           message="m") for i in range(SHOWN_OK + 1)]
    why = "CPU/gloo processes share the host's cores " * 6  # past the 200 columns of a log
    judging = {"name": "shared-cores", "device_warn": 0.6, "link_warn": 0.45, "critical": 0.4,
               "why": why.strip()}
    render(PreflightReport(world=SHOWN_OK + 1, results=results, judging=judging), as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert not any("NODE" in line or "┏" in line for line in out), out
    assert out[0] == f"preflight (quick, world {SHOWN_OK + 1}): no failure to list"
    assert out[1].startswith(f"OK: {SHOWN_OK + 1} results not listed (gemm {SHOWN_OK + 1})")
    assert out[2].startswith("judged with the shared-cores tolerance (below 0.6 x")
    assert out[2].endswith("share the host's cores)") and len(out[2]) > 200  # one line
    assert out[3:] == ["status OK; bad nodes: none"]


def test_links_of_one_kind_are_judged_against_links_over_the_same_span():
    """tp4·pp4 on two 8-GPU nodes: two of its three stage boundaries stay in a node (NVLink),
    one crosses the NICs. Judged together, every healthy cross-node pair sat at a tenth of the
    NVLink median and was CRITICAL; judged among themselves they are OK, and a slow one of them
    is still caught."""
    from mscale.preflight.report import _link_results

    node_of = {r: "node1" if r < 8 else "node2" for r in range(16)}
    pairs = [(s * 4 + i, s * 4 + 4 + i) for s in range(3) for i in range(4)]

    def results(slow: tuple[int, int] | None):
        items = [{"kind": "pp", "ranks": list(p),
                  "gbps": (2.0 if p == slow else 10.0) if node_of[p[0]] != node_of[p[1]]
                  else 100.0} for p in pairs]
        payloads = [{"rank": 0, "node": "node1", "device": "cpu", "pairs": items}]
        return {tuple(r.ranks): r for r in _link_results(None, payloads, node_of)}

    healthy = results(None)
    assert {r.status for r in healthy.values()} == {"OK"}
    assert healthy[(4, 8)].message == "pp pair (across nodes) on node1,node2"
    assert healthy[(0, 4)].message == "pp pair (in a node) on node1"
    slow = results((5, 9))
    assert slow[(5, 9)].status == "CRITICAL"
    assert {r.status for k, r in slow.items() if k != (5, 9)} == {"OK"}
