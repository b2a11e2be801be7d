"""watch/report.py over a whole session: one pair of heat maps per attempt of the job."""

from __future__ import annotations

import re

from mscale.watch.follow import KEPT_ATTEMPTS

from tests.unit.watch.pages import network_references
from tests.unit.watch.replanned import replanned_run
from tests.unit.watch.follow_fakes import make, recs


def test_a_replanned_runs_report_shows_each_attempts_heat_maps(cli, tmp_path):
    """After recover relaunched on fewer nodes, the report held the newest attempt's maps only:
    the first attempt, where the slow rank was, was gone from the page."""
    rd = replanned_run(str(tmp_path / "run"))
    page_path = tmp_path / "watch.html"
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--report", str(page_path))
    assert code == 2, err
    page = page_path.read_text()
    assert re.findall(r"<h3>([^<]*)</h3>", page) == [
        "attempt 1: tp 2 × pp 2 × dp 2 on node1, node2, node3, node4 (steps 1–40)",
        "attempt 2: tp 2 × pp 2 × dp 1 on node1, node2 (steps 31–60)"]
    assert page.count("<svg") == 1 + 2 * 2  # the curves, then compute and wait per attempt
    assert network_references(page) == []


def test_the_newest_attempts_are_kept_for_the_report(tmp_path):
    restarts = KEPT_ATTEMPTS + 2
    f, _, _ = make(tmp_path, [recs(1, 2)] * (restarts + 1),
                   restart_at=set(range(2, restarts + 2)))
    for _ in range(restarts + 1):
        f.poll()
    assert len(f.earlier) == KEPT_ATTEMPTS and f.attempts_dropped == 2
    assert len(f.attempts()) == KEPT_ATTEMPTS + 1 and f.attempts()[-1].history is f.history
