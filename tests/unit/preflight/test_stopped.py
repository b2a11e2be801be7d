"""A preflight that stopped before its end (preflight/stopped.py, runner's store records): the
report keeps every figure measured before the stop, marks what timed out UNKNOWN (which phase,
which ranks and nodes, after how long), and blames a node only where the evidence names one.
Before, one rank timing out under ``--timeout 1`` turned the whole report into one UNKNOWN
line and every GEMM and link figure the other ranks had measured was lost."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from torch.distributed import HashStore

from mscale.config.base import load_model
from mscale.config.plan import Plan
from mscale.preflight import marks, runner
from mscale.preflight.stopped import failure_report, spans
from mscale.preflight.table import failure_lines

from tests.unit.preflight.test_judge import _opts, _payloads

PLAN = "plans/cpu-tiny.yaml"
TIMED_OUT = "RuntimeError: Timed out waiting 1000ms for recv operation to complete"


def _stopped_in(phase: str, payloads: list[dict]) -> list[dict]:
    """What each rank had left in the store when ``phase`` stopped: the earlier phases' figures."""
    keep = {"compute": ("gemm",), "p2p": ("gemm",), "collectives": ("gemm", "pairs"),
            "recheck": ("gemm", "pairs", "groups", "host")}[phase]
    return [{k: v for k, v in p.items() if k in keep or k in ("rank", "node", "device",
                                                              "clock_offsets")}
            for p in payloads]


def _node(r: int) -> str:
    return f"node{r // 2 + 1}"


def test_a_collective_every_rank_timed_out_keeps_the_figures_and_blames_no_node(tmp_path):
    plan = load_model(Plan, PLAN)
    payloads = _stopped_in("collectives", _payloads(None))
    stops = {r: {"phase": "collectives", "after_s": 2.5 + r / 10, "error": TIMED_OUT}
             for r in range(8)}
    report = failure_report(plan, _opts(tmp_path), payloads, stops, [], _node)
    checks = [r.check for r in report.results]
    assert checks.count("gemm") == 8 and checks.count("p2p") > 0 and "clock_skew" in checks
    assert not {"allreduce", "allgather", "rank_alive"} & set(checks)
    stopped = [r for r in report.results if r.check == "stopped"]
    assert len(stopped) == 1 and stopped[0].status == "UNKNOWN" and stopped[0].node is None
    assert stopped[0].ranks == list(range(8))
    ev = stopped[0].evidence
    assert ev["phase"] == "collectives" and ev["timed_out"] and ev["after_s"] == 3.2
    assert ev["nodes"] == "node[1-4]" and ev["timeout_s"] == 10.0
    assert ev["not_measured"][0] == "allreduce, allgather, reduce_scatter"
    assert report.status == "UNKNOWN" and report.bad_nodes == [] and report.exclude == ""
    assert report.measured["gemm_tflops"]["median"] > 0 and "p2p_gbps" in report.measured
    line = failure_lines(report.results)
    assert len(line) == 1 and line[0].startswith("UNKNOWN: stopped phase collectives")
    assert "timed out (--timeout 10 s) on rank(s) 0-7 (node[1-4]), 3.2 s into" in line[0]
    assert "every rank answered: no node is blamed" in line[0]


def test_a_rank_that_never_answered_is_blamed_and_the_others_figures_stay(tmp_path):
    plan = load_model(Plan, PLAN)
    payloads = _stopped_in("p2p", _payloads(None))
    stops = {r: {"phase": "p2p", "after_s": 1.0, "error": TIMED_OUT} for r in range(8)
             if r != 5}
    report = failure_report(plan, _opts(tmp_path), payloads, stops, [5], _node)
    lost = [r for r in report.results if r.check == "rank_alive"]
    assert [(r.entity, r.node, r.status) for r in lost] == [("rank 5", "node3", "CRITICAL")]
    assert report.bad_nodes == ["node3"] and report.status == "CRITICAL"
    assert sum(r.check == "gemm" for r in report.results) == 8
    stopped = next(r for r in report.results if r.check == "stopped")
    assert stopped.ranks == [0, 1, 2, 3, 4, 6, 7] and "0-4,6-7" in stopped.message
    assert "named by rank_alive" in stopped.message


def test_a_slow_figure_measured_once_keeps_its_status_but_excludes_no_node(tmp_path):
    """The re-check never ran: a node is excluded only for a figure slow twice."""
    plan = load_model(Plan, PLAN)
    payloads = _stopped_in("collectives", _payloads(5))
    stops = {r: {"phase": "collectives", "after_s": 1.0, "error": TIMED_OUT} for r in range(8)}
    report = failure_report(plan, _opts(tmp_path), payloads, stops, [], _node)
    gemm5 = next(r for r in report.results if r.entity == "rank 5")
    assert gemm5.status == "CRITICAL" and gemm5.evidence["blamed"] is False
    assert "measured once" in gemm5.message and "exclude its node" not in gemm5.message
    assert report.status == "CRITICAL" and report.bad_nodes == [] and report.exclude == ""


def test_a_stop_in_the_recheck_keeps_the_whole_first_round(tmp_path):
    plan = load_model(Plan, PLAN)
    payloads = _stopped_in("recheck", _payloads(None))
    stops = {r: {"phase": "recheck", "after_s": None, "error": "RuntimeError: peer gone"}
             for r in range(8)}
    report = failure_report(plan, _opts(tmp_path), payloads, stops, [], _node)
    assert {"gemm", "p2p", "allreduce", "allgather", "clock_skew"} <= {
        r.check for r in report.results}
    stopped = next(r for r in report.results if r.check == "stopped")
    assert not stopped.evidence["timed_out"] and "failed on rank(s) 0-7" in stopped.message
    assert stopped.evidence["not_measured"] == ["the re-check of suspects"]


def test_rank_0_reads_every_ranks_figures_and_stop_from_the_store(monkeypatch):
    """Rank 1 finished the phase, rank 2 saw it fail, rank 3 never answered: all three
    leave their figures so far; only rank 3 is named."""
    store = HashStore()
    monkeypatch.setattr(marks, "store", lambda: store)
    monkeypatch.setattr(runner, "STOP_GRACE_S", 0.3)
    mine = {"rank": 0, "phase": "p2p", "gemm": {"tflops": 1.0}}
    for r in range(4):  # every rank's first mark, as in runner.measure
        marks.register(r, _node(r))
        marks.mark("start", r, {"rank": r, "phase": "start"})
    marks.mark("compute", 3, {"rank": 3, "phase": "compute", "gemm": {"tflops": 0.2}})
    marks.mark("p2p", 1, {"rank": 1, "phase": "p2p", "gemm": {"tflops": 1.1}, "pairs": []})
    runner._mark_failed({"rank": 2, "phase": "p2p", "gemm": {"tflops": 0.9}}, 2,
                        RuntimeError("Timed out waiting 1000ms\nmore"))
    payloads, stops, lost, node_of = runner._when_stopped(4, mine, RuntimeError("Timed out"))
    assert [p["rank"] for p in payloads] == [0, 1, 2, 3] and lost == [3]
    assert payloads[3]["gemm"] == {"tflops": 0.2}
    assert set(stops) == {0, 2} and node_of(3) == "node2"
    assert stops[2] == {"phase": "p2p", "after_s": None,
                        "error": "RuntimeError: Timed out waiting 1000ms", "finished": False}
    json.dumps(stops)


def test_spans_name_thousands_of_ranks_in_a_few_characters():
    assert spans([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert spans(list(range(12288))) == "0-12287"


class _Counted:
    """A store that counts its round trips (every call) and can act on a later call."""

    def __init__(self, then=None):
        self.inner, self.calls, self.then = HashStore(), 0, then

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            self.calls += 1
            if self.then and self.then(name, args):
                self.then = None
            return method(*args)
        return call


def _waiting(monkeypatch, store, answer):
    """``store`` is the job's; the grace's first wait lets a rank still working ``answer``."""
    monkeypatch.setattr(marks, "store", lambda: store)
    waits = []

    def sleep(s):
        waits.append(s)
        if len(waits) == 1:
            answer()
    monkeypatch.setattr(marks, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    return waits


def test_a_rank_that_finished_the_phase_then_failed_is_one_answer_not_two(monkeypatch):
    """Rank 0 stopped in p2p; rank 1 finished p2p and then failed in the collectives; rank 3
    finished p2p; rank 2, whose own timeout began later, answers during the grace. Rank 1 was
    counted twice, the grace ended at once and healthy rank 2 was named dead (rank_alive,
    CRITICAL, its node excluded)."""
    waits = _waiting(monkeypatch, HashStore(), lambda: runner._mark_failed(
        {"rank": 2, "phase": "p2p"}, 2, RuntimeError("Timed out")))
    marks.mark("p2p", 1, {"rank": 1})
    runner._mark_failed({"rank": 1, "phase": "collectives"}, 1, RuntimeError("Timed out"))
    marks.mark("p2p", 3, {"rank": 3})
    assert marks.missing_ranks("p2p", 4, grace_s=30.0) == [] and len(waits) == 1


def test_rank_0s_own_mark_of_its_phase_is_not_an_answer(monkeypatch):
    """Rank 0 failed in the gather after 'host', which it had marked; rank 3 is still in its
    host checks (a slow storage probe) and finishes them during the grace."""
    waits = _waiting(monkeypatch, HashStore(), lambda: marks.mark("host", 3, {"rank": 3}))
    for r in range(3):
        marks.mark("host", r, {"rank": r})
    assert marks.missing_ranks("host", 4, grace_s=30.0) == [] and len(waits) == 1


def test_a_rank_that_answers_during_the_read_back_is_not_both_dead_and_answering(monkeypatch):
    """One reading decides: rank 3, silent through the grace, said it failed while rank 0
    read the figures; it was named dead and listed among the ranks that answered."""
    def late(name, args):
        if name in ("get", "multi_get") and "payload" in str(args):
            runner._mark_failed({"rank": 3, "phase": "p2p"}, 3, RuntimeError("Timed out"))
            return True
        return False
    store = _Counted(late)
    monkeypatch.setattr(marks, "store", lambda: store)
    monkeypatch.setattr(runner, "STOP_GRACE_S", 0.0)
    for r in (1, 2):
        runner._mark_failed({"rank": r, "phase": "p2p"}, r, RuntimeError("Timed out"))
    _, stops, lost, _ = runner._when_stopped(4, {"rank": 0, "phase": "p2p"}, RuntimeError("x"))
    assert lost == [3] and set(stops) == {0, 1, 2}


def test_the_read_back_costs_a_few_round_trips_and_two_per_chunk_of_ranks(monkeypatch):
    """It runs after --timeout expired: a key per rank cost ~6 round trips a rank (~74,000 at
    12,288 ranks); now a few, plus one per CHUNK records."""
    monkeypatch.setattr(runner, "STOP_GRACE_S", 0.0)
    monkeypatch.setattr(marks, "CHUNK", 100)
    cost = {}
    for world in (50, 400):
        store = _Counted()
        monkeypatch.setattr(marks, "store", lambda: store)
        for r in range(1, world - 2):  # the last two ranks never answered
            marks.register(r, _node(r))
            marks.mark("start", r, {"rank": r, "node": _node(r)})
            runner._mark_failed({"rank": r, "phase": "p2p"}, r, RuntimeError("Timed out"))
        store.calls = 0
        payloads, stops, lost, _ = runner._when_stopped(
            world, {"rank": 0, "phase": "p2p"}, RuntimeError("Timed out"))
        assert len(payloads) == len(stops) == world - 2 and lost == [world - 2, world - 1]
        cost[world] = store.calls
    assert cost[50] <= 8 and cost[400] - cost[50] == 2 * (4 - 1)  # 2 kinds, 4 chunks not 1


def test_a_stop_after_the_host_checks_does_not_say_they_were_not_measured(tmp_path):
    """Every rank had finished and stored its host checks when the gather to rank 0 timed out
    (one node's storage probe took the whole --timeout): the report holds every host result,
    and its stop line said 'not measured: host checks'."""
    plan = load_model(Plan, PLAN)
    payloads = _stopped_in("recheck", _payloads(None))
    payload = {"phase": "host", "phase_t0": time.monotonic(), "stored": "host"}
    seen = runner.stop_record(payload, RuntimeError("Timed out waiting 1000ms"))
    assert seen["finished"] is True
    report = failure_report(plan, _opts(tmp_path), payloads, dict.fromkeys(range(8), seen), [],
                            _node)
    stopped = next(r for r in report.results if r.check == "stopped")
    assert stopped.evidence["not_measured"] == ["the re-check of suspects"]
    assert stopped.message.startswith("'host' (host checks) finished; the exchange with rank 0 "
                                      "after it timed out (--timeout 10 s) on rank(s) 0-7")
    assert "not measured: the re-check of suspects;" in stopped.message
