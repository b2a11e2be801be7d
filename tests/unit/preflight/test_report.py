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
