"""The outlier rules, link blame, the job status and the report's bad nodes and exclude list."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from mscale.config.base import load_model
from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult
from mscale.config.records import Quarantine, QuarantineEntry
from mscale.preflight import judge
from mscale.preflight.report import assemble, prometheus_text, quarantined
from mscale.preflight.table import failure_lines


def test_one_slow_device_among_eight_is_critical_and_noise_is_not():
    values = {r: 100.0 + (r % 3) for r in range(8)}
    values[5] = 25.0
    v = judge.judge_peers(values)
    assert v[5].status == "CRITICAL"
    assert all(v[r].status == "OK" for r in values if r != 5)


def test_few_devices_sigma_cannot_flag_but_median_rules_do():
    # four values: mean - 2 sigma can never flag one of them ((n-1)/sqrt(n) = 1.5 sigma)
    v = judge.judge_peers({0: 3.4, 1: 2.6, 2: 0.9, 3: 4.1})
    assert v[2].status == "CRITICAL"
    v = judge.judge_peers({0: 10.0, 1: 10.1, 2: 7.0, 3: 9.9})  # 0.7 x median, MAD tiny
    assert v[2].status == "WARNING"
    assert judge.judge_peers({0: 10.0, 1: 10.1, 2: 7.0, 3: 9.9}, warn=0.6)[2].status == "OK"


def test_within_twenty_percent_is_never_flagged_even_with_zero_spread():
    v = judge.judge_peers({0: 10.0, 1: 10.0, 2: 10.0, 3: 8.5})
    assert v[3].status == "OK"


def test_of_two_values_the_one_far_below_the_other_is_critical_and_noise_is_not():
    """A 2-node job has two TP groups: one at 0.0013 GB/s beside one at 0.88 (a node whose
    network sends at 2 MB/s) was OK before, and preflight passed (exit 0)."""
    v = judge.judge_peers({0: 0.8837, 1: 0.001313}, warn=0.45, critical=0.4)
    assert (v[0].status, v[1].status) == ("OK", "CRITICAL")
    assert v[1].evidence["fraction_of_median"] < 0.01 and "one peer" in v[1].expected
    assert {x.status for x in judge.judge_peers({0: 1.0, 1: 0.7}, critical=0.4).values()} == {
        "OK"}  # a healthy link on shared cores was seen at 0.7 x
    assert judge.judge_peers({0: 1.0})[0].status == "OK"


def test_link_rate():
    assert judge.judge_rate(10.0, None) == ("OK", "")
    assert judge.judge_rate(10.0, 100.0)[0] == "CRITICAL"
    assert judge.judge_rate(50.0, 100.0)[0] == "WARNING"
    assert judge.judge_rate(90.0, 100.0)[0] == "OK"


def _link(ranks, status):
    return CheckResult(check="p2p", entity_kind="pair", entity="-".join(map(str, ranks)),
                       ranks=list(ranks), value=1.0, status=status)


def test_blame_names_the_rank_slow_on_every_peer_set_not_its_peers():
    node_of = {r: f"node{r // 2 + 1}" for r in range(8)}
    links = [_link((4, 5), "CRITICAL"), _link((5, 7), "CRITICAL"), _link((1, 5), "WARNING"),
             _link((4, 6), "OK"), _link((0, 4), "OK"), _link((6, 7), "OK")]
    judge.blame_links(links, node_of)
    assert [r.node for r in links[:3]] == ["node3"] * 3


def test_blame_a_single_slow_link_between_healthy_nodes_on_nobody():
    node_of = {r: f"node{r // 2 + 1}" for r in range(8)}
    links = [_link((0, 2), "CRITICAL"), _link((0, 1), "OK"), _link((2, 3), "OK")]
    judge.blame_links(links, node_of)
    assert links[0].node is None


def test_blame_a_slow_link_inside_one_node_on_that_node():
    """Both ends on node2 and no rank slow on two peer sets (a 2-node tp2 dp2 job): no switch
    lies between them, so node2 is at fault; a slow link across two nodes stays unblamed."""
    node_of = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    links = [_link((2, 3), "CRITICAL"), _link((0, 1), "OK"), _link((1, 3), "OK")]
    judge.blame_links(links, node_of)
    assert [r.node for r in links] == ["node2", None, None]
    assert "all its ranks are on node2" in links[0].message
    across = [_link((0, 2), "CRITICAL"), _link((0, 1), "OK"), _link((2, 3), "OK")]
    judge.blame_links(across, node_of)
    assert across[0].node is None


def test_job_status_ranks_unknown_between_ok_and_warning():
    mk = lambda s: CheckResult(check="x", entity_kind="job", entity="j", status=s)  # noqa: E731
    assert judge.job_status([mk("OK"), mk("UNKNOWN")]) == "UNKNOWN"
    assert judge.job_status([mk("UNKNOWN"), mk("WARNING")]) == "WARNING"
    assert judge.job_status([mk("CRITICAL"), mk("WARNING")]) == "CRITICAL"
    assert judge.exit_code("CRITICAL") == 2


def _payloads(slow_rank: int | None) -> list[dict]:
    from mscale.preflight.network import plan_pairs
    from mscale.topology.placement import Placement

    p = Placement(tp=2, pp=2, dp=2, gpus_per_node=2)
    out = []
    for r in range(8):
        f = 4.0 if r == slow_rank else 1.0
        pairs = [{"kind": k, "ranks": [a, b], "gbps": 4.0 / (4.0 if slow_rank in (a, b) else 1)}
                 for k, a, b in plan_pairs(p) if r in (a, b)]
        groups = []
        for kind, gs in (("tp", p.tp_groups), ("pp", p.pp_groups), ("dp", p.dp_groups)):
            g = p.group_of(gs, r)
            s = 0.001 * (4.0 if slow_rank in g else 1.0)
            groups += [{"kind": kind, "op": op, "ranks": g, "seconds": s, "bytes": 1 << 20,
                        "algbw": 1.0 / s, "busbw": 1.0 / s} for op in ("allreduce", "allgather")]
        out.append({"rank": r, "node": f"node{r // 2 + 1}", "device": "cpu",
                    "gemm": {"tflops": 0.1 / f, "n": 384, "dtype": "float32"},
                    "pairs": pairs, "groups": groups, "host": []})
    out[0]["clock_offsets"] = [0.0] * 8
    return out


def _opts(tmp_path):
    return SimpleNamespace(run_dir=str(tmp_path), level="quick", plan_path="plan.yaml",
                           timeout_s=10.0)


def test_report_names_only_the_slow_ranks_node_and_merges_live_quarantine(tmp_path):
    plan = load_model(Plan, "plans/cpu-tiny.yaml")
    q = Quarantine(entries=[QuarantineEntry(node="node9", reason="watch"),
                            QuarantineEntry(node="node8", reason="old", expires=time.time() - 1)])
    (tmp_path / "quarantine.json").write_text(q.model_dump_json())
    report = assemble(plan, _opts(tmp_path), _payloads(5))
    assert report.bad_nodes == ["node3", "node9"]
    assert report.exclude == "node[3,9]"
    assert report.status == "CRITICAL"
    assert report.measured["gemm_tflops"]["median"] > 0.09
    assert set(report.measured["busbw_gbps"]) == {"tp", "pp", "dp"}
    assert quarantined(str(tmp_path)) == ["node9"]
    assert b"mscale_preflight_job_status 2.0" in prometheus_text(report)
    json.loads(report.model_dump_json())


def test_a_quarantined_node_of_the_job_is_critical_not_only_excluded(tmp_path):
    """A healthy job on a quarantined node: exit 2 (CRITICAL), so that a batch script that
    excludes on 2 keeps it out; a quarantined node outside the job is excluded, status OK."""
    plan = load_model(Plan, "plans/cpu-tiny.yaml")
    q = Quarantine(entries=[QuarantineEntry(node="node3", reason="watch: slow link"),
                            QuarantineEntry(node="node9", reason="elsewhere")])
    (tmp_path / "quarantine.json").write_text(q.model_dump_json())
    report = assemble(plan, _opts(tmp_path), _payloads(None))
    assert report.status == "CRITICAL" and report.exclude == "node[3,9]"
    flagged = [r for r in report.results if r.check == "quarantine"]
    assert [r.node for r in flagged] == ["node3"]
    assert "node3 is quarantined until a person clears it: watch: slow link" in flagged[0].message


def test_report_of_a_healthy_job_is_ok(tmp_path):
    plan = load_model(Plan, "plans/cpu-tiny.yaml")
    report = assemble(plan, _opts(tmp_path), _payloads(None))
    assert report.status == "OK" and report.exclude == ""


def _two_node_payloads(slow_node: str | None) -> list[dict]:
    """tp2 dp2 on node[1-2] (TP inside a node, DP across), every process of ``slow_node``
    sending at 2 MB/s: the figures `mscale preflight --local 4` measured with the slowlink
    shim on node2 (tests/faults/slowlink.c), GB/s."""
    from mscale.preflight.network import plan_pairs
    from mscale.topology.placement import Placement

    p = Placement(tp=2, pp=1, dp=2, gpus_per_node=2)
    node = {r: f"node{r // 2 + 1}" for r in range(4)}
    slow = {r for r in range(4) if node[r] == slow_node}

    def gbps(ranks, fast):
        return 0.002 if slow & set(ranks) else fast

    out = []
    for r in range(4):
        pairs = [{"kind": k, "ranks": [a, b], "gbps": gbps((a, b), 3.2 if k == "tp" else 1.5)}
                 for k, a, b in plan_pairs(p) if r in (a, b)]
        groups = []
        for kind, gs in (("tp", p.tp_groups), ("dp", p.dp_groups)):
            g = p.group_of(gs, r)
            bw = gbps(g, 0.9 if kind == "tp" else 0.4)
            groups += [{"kind": kind, "op": op, "ranks": g, "seconds": 1 / bw, "bytes": 1 << 20,
                        "algbw": bw, "busbw": bw} for op in ("allreduce", "allgather")]
        out.append({"rank": r, "node": node[r], "device": "cpu",
                    "gemm": {"tflops": 0.087, "n": 384, "dtype": "float32"},
                    "pairs": pairs, "groups": groups, "host": []})
    out[0]["clock_offsets"] = [0.0] * 4
    return out


def test_a_two_node_job_names_the_node_whose_network_is_slow(tmp_path):
    """Before, every figure of a 2-node job was 'compared with peers (needs >= 3)': status OK,
    bad nodes none, with node2's links 450 x slower than node1's."""
    import yaml

    data = yaml.safe_load(open("plans/cpu-tiny.yaml"))
    data["cluster"]["hostlist"] = "node[1-2]"
    data["layout"]["pp"] = 1
    plan = Plan.model_validate(data)
    report = assemble(plan, _opts(tmp_path), _two_node_payloads("node2"))
    assert (report.status, report.bad_nodes, report.exclude) == ("CRITICAL", ["node2"], "node2")
    flagged = {r.entity for r in report.results if r.status == "CRITICAL"}
    assert flagged == {"2-3", "tp[2,3]"}, flagged
    [line] = failure_lines(report.results)
    assert line.startswith("CRITICAL: node2 is at fault, its links inside the node are slow")
    healthy = assemble(plan, _opts(tmp_path), _two_node_payloads(None))
    assert (healthy.status, healthy.exclude) == ("OK", "")


def test_slow_links_of_a_stopped_preflight_exclude_no_node_and_say_so():
    """Measured before a collective timed out, so never re-checked: the node line said `node2
    is at fault` above `bad nodes: none`."""
    links = [_link(ranks, "CRITICAL") for ranks in ((1, 3), (2, 3))]
    for r in links:
        r.node = "node2"
        r.evidence.update(measured_once=True, blamed=False, fraction_of_median=0.03)
    [line] = failure_lines(links)
    assert line.startswith("CRITICAL: node2 looks at fault, its rank(s) slow on every peer set")
    assert "measured once (the preflight stopped before the re-check): no node is excluded" in line
