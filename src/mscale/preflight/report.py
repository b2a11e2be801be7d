"""From every rank's figures to ``preflight.json``, the table, the exclude list and the exit code.

Rank 0 judges once, with everybody's numbers in hand (judge.py): GEMM per device against the
other devices, each pair against pairs of its kind, each group's bus bandwidth against the other
groups of its kind and collective, and, on NCCL, against the cluster file's link rate. The bad
nodes are those a CRITICAL result is blamed on, merged with the unexpired nodes of
``quarantine.json``; the exclude list is their SLURM hostlist.
"""

from __future__ import annotations

import statistics
import time
from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult, PreflightReport
from mscale.config.records import QUARANTINE_FIX, Quarantine
from mscale.hostlist import collect_hostlist
from mscale.preflight import judge, recheck
from mscale.preflight.storage import blame_storage
from mscale.preflight.table import render
from mscale.runs.atomic import fs_and_path, write_bytes_atomic, write_json_atomic
from mscale.runs.rundir import RunDir
from mscale.topology.placement import placement_for

SKEW_WARN_S = 0.1
SKEW_CRIT_S = 1.0


def _gemm_results(payloads: list[dict], tol: judge.Tolerance) -> list[CheckResult]:
    payloads = [p for p in payloads if "gemm" in p]  # a stopped job's ranks may not have one
    values = {p["rank"]: p["gemm"]["tflops"] for p in payloads}
    verdicts = judge.judge_peers(values, warn=tol.device_warn, critical=tol.critical)
    out = []
    for p in payloads:
        v, g = verdicts[p["rank"]], p["gemm"]
        msg = (f"{g['dtype']} {g['n']}x{g['n']} matmul at {v.evidence.get('fraction_of_median', 1):.0%}"
               " of the peers' median" if v.evidence else f"{g['dtype']} {g['n']}x{g['n']} matmul")
        if v.status != "OK":
            msg += ": a slow device (throttled, degraded, or sharing its cores); exclude its node"
        out.append(CheckResult(check="gemm", entity_kind="rank", entity=f"rank {p['rank']}",
                               node=p["node"], ranks=[p["rank"]], value=g["tflops"],
                               unit="TFLOP/s", expected=v.expected, status=v.status,
                               message=msg, evidence=v.evidence))
    return out


def _link_rate(plan: Plan, ranks: list[int], nccl: bool) -> float | None:
    """The cluster file's per-GPU GB/s for a link (None on gloo: CPUs are not the cluster)."""
    if not nccl:
        return None
    placement = placement_for(plan)
    if len({placement.node(r) for r in ranks}) == 1:
        return plan.cluster.domain_gb_per_s
    return plan.cluster.node_gb_per_s / plan.cluster.gpus_per_node


def _judged(check: str, kind_key: str, items: list[dict], value_key: str, unit: str,
            plan: Plan, nccl: bool, node_of: dict[int, str]) -> list[CheckResult]:
    """Judge link items (pairs or groups) of one kind against their peers and the link rate."""
    out = []
    tol = judge.tolerance_for(nccl)
    verdicts = judge.judge_peers({i: it[value_key] for i, it in enumerate(items)},
                                 warn=tol.link_warn, critical=tol.critical)
    for i, it in enumerate(items):
        v = verdicts[i]
        rate_status, rate_expected = judge.judge_rate(
            it[value_key], _link_rate(plan, it["ranks"], nccl))
        status = judge.worse(v.status, rate_status)
        entity = (f"{it['ranks'][0]}-{it['ranks'][1]}" if check == "p2p"
                  else f"{it['kind']}[{','.join(map(str, it['ranks']))}]")
        nodes = sorted({node_of[r] for r in it["ranks"]})
        msg = f"{kind_key} on {','.join(nodes)}"
        if status != "OK":
            msg += ": slower than its peers" if v.status != "OK" else ": below the link rate"
        if it.get("cut_short"):
            msg += (f" (cut short after a {it['bytes'] / 2**20:.3g} MiB probe: far below its "
                    "peers, the full test could not change the verdict)")
        out.append(CheckResult(
            check=check, entity_kind="pair" if check == "p2p" else "group", entity=entity,
            ranks=it["ranks"], value=it[value_key], unit=unit,
            expected="; ".join(x for x in (v.expected, rate_expected) if x), status=status,
            message=msg, evidence={**v.evidence, **{k: it[k] for k in it if k != "ranks"}}))
    return out


def _span(ranks: list[int], node_of: dict[int, str]) -> str:
    """Whether a link stays inside one node (NVLink on GPUs) or crosses nodes (the NICs)."""
    return "in a node" if len({node_of.get(r) for r in ranks}) == 1 else "across nodes"


def _link_results(plan: Plan, payloads: list[dict], node_of: dict[int, str]) -> list[CheckResult]:
    """Pairs and groups judged against their peers: the same kind over the same span. A layout
    can put some links of one kind inside a node and others across nodes (tp4·pp4 on 8-GPU
    nodes: two of its three stage boundaries are NVLink, one a NIC); judged together, every
    healthy cross-node link sat far below the NVLink median and was CRITICAL."""
    nccl = on_gpu(payloads)
    pairs: dict[tuple[str, str], dict[tuple, dict]] = {}
    for p in payloads:  # a pair's figure: its slower end's
        for it in p.get("pairs", []):
            have = pairs.setdefault((it["kind"], _span(it["ranks"], node_of)), {})
            key = tuple(it["ranks"])
            if key not in have or it["gbps"] < have[key]["gbps"]:
                have[key] = it
    groups: dict[tuple[str, str, str], dict[tuple, dict]] = {}
    for p in payloads:  # a group's time: its slowest member's best
        for it in p.get("groups", []):
            key = tuple(it["ranks"])
            have = groups.setdefault((it["kind"], _span(it["ranks"], node_of), it["op"]), {})
            if key not in have or it["seconds"] > have[key]["seconds"]:
                have[key] = it
    spans: dict[object, set[str]] = {}  # pair kind, or (group kind, op) → its links' spans
    for kind, span in pairs:
        spans.setdefault(kind, set()).add(span)
    for kind, span, op in groups:
        spans.setdefault((kind, op), set()).add(span)
    mixed = {k for k, found in spans.items() if len(found) > 1}
    out = []
    for (kind, span), items in sorted(pairs.items()):
        label = f"{kind} pair" + (f" ({span})" if kind in mixed else "")
        out += _judged("p2p", label, list(items.values()), "gbps", "GB/s", plan, nccl, node_of)
    for (kind, span, op), items in sorted(groups.items()):
        label = f"{kind} group" + (f" ({span})" if (kind, op) in mixed else "")
        out += _judged(op, label, list(items.values()), "busbw", "GB/s busbw", plan, nccl,
                       node_of)
    return out


def skew_results(payloads: list[dict]) -> list[CheckResult]:
    offsets = next((p["clock_offsets"] for p in payloads if "clock_offsets" in p), None)
    if offsets is None:
        return []
    by_node: dict[str, list[float]] = {}
    for p in payloads:
        by_node.setdefault(p["node"], []).append(offsets[p["rank"]])
    out = []
    for node, offs in by_node.items():
        skew = statistics.median(offs)
        status = ("CRITICAL" if abs(skew) > SKEW_CRIT_S else
                  "WARNING" if abs(skew) > SKEW_WARN_S else "OK")
        out.append(CheckResult(
            check="clock_skew", entity_kind="node", entity=node, node=node, value=skew, unit="s",
            expected=f"|skew| <= {SKEW_WARN_S:g} s vs rank 0", status=status,
            message="wall clock against rank 0's" + ("" if status == "OK" else
                    ": events and traces from this node will be misordered; fix its NTP")))
    return out


def measured_figures(results: list[CheckResult], payloads: list[dict]) -> dict:
    """What `plan --calibrate` can read instead of datasheet constants."""
    tf = [r.value for r in results if r.check == "gemm" and r.value is not None]
    out: dict = {}
    if tf:
        g = next(p["gemm"] for p in payloads if "gemm" in p)
        out["gemm_tflops"] = {"median": statistics.median(tf), "min": min(tf),
                              "dtype": g["dtype"], "n": g["n"]}
    for r in results:
        if r.entity_kind in ("pair", "group") and r.value is not None:
            kind = r.evidence.get("kind", "")
            out.setdefault("busbw_gbps" if r.check != "p2p" else "p2p_gbps", {}).setdefault(
                kind, {}).setdefault(r.check, []).append(r.value)
    for key in ("busbw_gbps", "p2p_gbps"):
        for kind, by_op in out.get(key, {}).items():
            for op, vals in by_op.items():
                by_op[op] = statistics.median(vals)
    storage = {r.check: r.value for r in results if r.check.startswith("storage")}
    if storage:
        out["storage"] = storage
    return out


def quarantined(run_dir: str, now: float | None = None) -> list[str]:
    """Nodes ``quarantine.json`` still keeps out (no expiry, or not expired yet)."""
    return sorted({e.node for e in _live_quarantine(run_dir, now)})


def _live_quarantine(run_dir: str, now: float | None = None) -> list:
    from mscale.config.base import load_json_model

    path = RunDir(run_dir).quarantine
    fs, p = fs_and_path(path)
    if not fs.isfile(p):
        return []
    now = time.time() if now is None else now
    return [e for e in load_json_model(Quarantine, path, fix=QUARANTINE_FIX).entries
            if e.expires is None or e.expires > now]


def quarantine_results(run_dir: str, job_nodes: set[str],
                       now: float | None = None) -> list[CheckResult]:
    """One CRITICAL result for each node of this job that ``quarantine.json`` keeps out. A
    quarantined node merely merged into the exclude list left the status OK (exit 0), and a
    batch script that excludes nodes on exit 2 (docs/recover.md) trained on it."""
    out = []
    for e in _live_quarantine(run_dir, now):
        if e.node not in job_nodes:
            continue
        until = ("until a person clears it" if e.expires is None else
                 "until " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(e.expires)))
        out.append(CheckResult(
            check="quarantine", entity_kind="node", entity=e.node, node=e.node,
            status="CRITICAL", expected="not in quarantine.json",
            message=f"{e.node} is quarantined {until}: {e.reason}; exclude it, or remove its "
                    "entry from quarantine.json once it is repaired",
            evidence={"since": e.since, "expires": e.expires}))
    return out


def finish(plan: Plan, opts, world: int, results: list[CheckResult],
           node_of: dict[int, str]) -> PreflightReport:
    """Blame links, collect the bad nodes and the exclude list, the job's status."""
    judge.blame_links(results, node_of)
    blame_storage(results)
    results = results + quarantine_results(opts.run_dir, set(node_of.values()))
    bad = {r.node for r in results if r.status == "CRITICAL" and r.node
           and r.evidence.get("blamed") is not False}
    bad |= set(quarantined(opts.run_dir))
    return PreflightReport(level=opts.level, plan=opts.plan_path, world=world,
                           layout={"tp": plan.layout.tp, "pp": plan.layout.pp,
                                   "dp": plan.layout.dp},
                           results=results, bad_nodes=sorted(bad),
                           exclude=collect_hostlist(sorted(bad)),
                           status=judge.job_status(results))


def on_gpu(payloads: list[dict]) -> bool:
    return any(p.get("device") == "cuda" for p in payloads)


def judged_measurements(plan: Plan, payloads: list[dict]) -> list[CheckResult]:
    """GEMM, pairs and groups judged against their peers (and on NCCL the link rate)."""
    node_of = {p["rank"]: p["node"] for p in payloads}
    tol = judge.tolerance_for(on_gpu(payloads))
    return _gemm_results(payloads, tol) + _link_results(plan, payloads, node_of)


def assemble(plan: Plan, opts, payloads: list[dict],
             again: list[dict] | None = None) -> PreflightReport:
    """Rank 0: every rank's payload (and the re-measured suspects, ``again``) → the report."""
    node_of = {p["rank"]: p["node"] for p in payloads}
    results = judged_measurements(plan, payloads)
    suspects = recheck.suspects(results)
    if again is not None:
        second = judged_measurements(plan, recheck.second_round_payloads(payloads, again))
        results = recheck.combine(results, second)
    results += skew_results(payloads)
    for p in payloads:
        results += [CheckResult.model_validate(r) for r in p.get("host", [])]
    report = finish(plan, opts, len(payloads), results, node_of)
    report.measured = measured_figures(results, payloads)
    tol = judge.tolerance_for(on_gpu(payloads))
    report.judging = {**tol.as_record(), "rechecked": suspects.count() if again else 0,
                      "cleared": sum(1 for r in results
                                     if r.evidence.get("rounds") and not recheck.flagged(r))}
    return report


def prometheus_text(report: PreflightReport) -> bytes:
    """The report as a node-exporter textfile, rendered by ``prometheus-client`` (as watch's is,
    so label values are escaped): one status gauge per result (check, entity, node), its value
    where it has one (with its unit), and the job's status."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from mscale.config.preflight import STATUS_CODE

    reg = CollectorRegistry()
    labels = ("check", "entity", "node")
    status = Gauge("mscale_preflight_status", "Nagios status of a preflight check (0 OK .. 3 "
                   "UNKNOWN)", labels, registry=reg)
    value = Gauge("mscale_preflight_value", "Measured value of a preflight check (see unit)",
                  (*labels, "unit"), registry=reg)
    for r in report.results:
        status.labels(r.check, r.entity, r.node or "").set(STATUS_CODE[r.status])
        if r.value is not None:
            value.labels(r.check, r.entity, r.node or "", r.unit).set(r.value)
    Gauge("mscale_preflight_job_status", "Nagios status of the whole preflight (0 OK .. 3 "
          "UNKNOWN)", registry=reg).set(STATUS_CODE[report.status])
    return generate_latest(reg)


def publish(report: PreflightReport, opts, quiet: bool) -> int:
    """Write preflight.json (and the textfile), print unless a launcher will; the exit code."""
    run = RunDir(opts.run_dir)
    write_json_atomic(run.preflight, report.model_dump(mode="json"))
    if opts.prometheus:
        write_bytes_atomic(opts.prometheus, prometheus_text(report))
    if not quiet:
        render(report, opts.as_json)
        say_written(opts)
    return judge.exit_code(report.status)


def say_written(opts, since: float | None = None) -> None:
    """Name every file preflight wrote, on stderr (stdout keeps the table or the ``--json``
    document): ``wrote preflight report: RUN_DIR/preflight.json``, ``wrote Prometheus textfile:
    FILE``. A file a command writes without saying so is one a newcomer does not know of.
    ``since``: the ``--local`` launcher's start, when rank 0 wrote the files: a textfile not
    written since is said to be missing, not "wrote" (rank 0's log says why)."""
    import sys

    sys.stdout.flush()  # after the table when both go to one terminal or file
    sys.stderr.write(f"wrote preflight report: {RunDir(opts.run_dir).preflight}\n")
    if opts.prometheus and since is not None and not _written_since(opts.prometheus, since):
        sys.stderr.write(f"WARNING the Prometheus textfile {opts.prometheus} was not written: "
                         "rank 0's log says why\n")
    elif opts.prometheus:
        sys.stderr.write(f"wrote Prometheus textfile: {opts.prometheus}\n")
    sys.stderr.flush()


def _written_since(url: str, since: float) -> bool:
    """Whether a file was written at or after ``since`` (True where its time cannot be read)."""
    fs, path = fs_and_path(url)
    try:
        info = fs.info(path)
    except (OSError, ValueError):
        return False
    mtime = info.get("mtime")
    return not isinstance(mtime, (int, float)) or mtime >= since - 1.0
