"""The second round: a suspect stays flagged only when it is slow twice; the CPU tolerance."""

from __future__ import annotations

import copy

from mscale.config.base import load_model
from mscale.config.plan import Plan
from mscale.preflight import judge
from mscale.preflight.recheck import second_round_payloads, suspects
from mscale.preflight.report import assemble, judged_measurements

from tests.unit.preflight.test_judge import _opts, _payloads

PLAN = "plans/cpu-tiny.yaml"


def _again(first: list[dict], slow_rank: int | None, what: set[str]) -> list[dict]:
    """The second round's payloads: the kinds in ``what`` re-measured, healthy unless slow."""
    healthy = _payloads(slow_rank)
    out = []
    for p, h in zip(first, healthy):
        again = {"rank": p["rank"]}
        if "gemm" in what:
            again["gemm"] = h["gemm"]
        if "pairs" in what:
            again["pairs"] = h["pairs"]
        if "groups" in what:
            again["groups"] = h["groups"]
        out.append(again)
    return out


def test_a_rank_slow_once_is_cleared_and_named_in_the_evidence(tmp_path):
    plan = load_model(Plan, PLAN)
    first = _payloads(None)
    first[6]["gemm"]["tflops"] = 0.03  # descheduled during the first round only
    found = suspects(judged_measurements(plan, first))
    assert found.gemm and not found.pairs and not found.groups
    report = assemble(plan, _opts(tmp_path), first, _again(first, None, {"gemm"}))
    gemm = {r.entity: r for r in report.results if r.check == "gemm"}
    assert report.status == "OK" and report.exclude == ""
    rounds = gemm["rank 6"].evidence["rounds"]
    assert rounds["statuses"] == ["CRITICAL", "OK"] and rounds["values"] == [0.03, 0.1]
    assert "first round only" in gemm["rank 6"].message
    assert report.judging["rechecked"] == 1 and report.judging["cleared"] == 1


def test_a_rank_slow_twice_stays_critical_with_both_figures(tmp_path):
    plan = load_model(Plan, PLAN)
    first = _payloads(5)
    found = suspects(judged_measurements(plan, first))
    assert found.gemm and found.pairs and found.groups
    again = _again(first, 5, {"gemm", "pairs", "groups"})
    report = assemble(plan, _opts(tmp_path), first, again)
    assert report.bad_nodes == ["node3"] and report.status == "CRITICAL"
    gemm = {r.entity: r for r in report.results if r.check == "gemm"}
    assert gemm["rank 5"].evidence["rounds"]["statuses"] == ["CRITICAL", "CRITICAL"]
    assert "slow in both rounds" in gemm["rank 5"].message
    assert report.judging["cleared"] == 0


def test_only_the_suspects_figures_are_replaced():
    first = _payloads(None)
    again = [{"rank": r, "pairs": [{"kind": "tp", "ranks": [4, 5], "gbps": 9.0}]}
             for r in (4, 5)] + [{"rank": r} for r in (0, 1, 2, 3, 6, 7)]
    merged = {p["rank"]: p for p in second_round_payloads(first, again)}
    tp45 = [it for it in merged[4]["pairs"] if it["kind"] == "tp" and it["ranks"] == [4, 5]]
    assert [it["gbps"] for it in tp45] == [9.0]
    assert merged[0] == {**first[0]} and merged[4]["gemm"] == first[4]["gemm"]
    assert len(merged[4]["pairs"]) == len(first[4]["pairs"])


def test_cpu_runs_get_the_shared_cores_tolerance_gpus_the_strict_one(tmp_path):
    plan = load_model(Plan, PLAN)
    first = _payloads(None)
    first[6]["gemm"]["tflops"] = 0.073  # 0.73 x the median: WARNING on a GPU, noise on CPUs
    assert not suspects(judged_measurements(plan, first))
    report = assemble(plan, _opts(tmp_path), first)
    assert report.status == "OK" and report.judging["name"] == "shared-cores"
    gpu = copy.deepcopy(first)
    for p in gpu:
        p["device"] = "cuda"
    flagged = [r for r in judged_measurements(plan, gpu) if r.status != "OK"]
    assert [(r.check, r.entity, r.status) for r in flagged] == [("gemm", "rank 6", "WARNING")]
    assert judge.tolerance_for(True) is judge.STRICT
