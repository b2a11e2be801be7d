"""The report of a preflight that stopped before its end (a collective timed out, a rank died):
every figure measured before the stop, what was not measured and why, and a node blamed only
where the evidence names one.

Each rank leaves its figures in the job's store at the end of every phase (`marks.mark`), and
a rank that sees a collective fail leaves what it saw (`runner.stop_record`); rank 0 reads them
once its own collective has failed (`runner._when_stopped`) and builds the report here. Before,
it kept none of them: one rank timing out under a short ``--timeout`` turned the report into a
single UNKNOWN line, and the GEMM and link figures the other ranks had measured were gone.

- A rank that never answered (neither finished the phase nor said it saw it fail) is CRITICAL
  ``rank_alive``, blamed on its node: a rank that stopped answering is evidence against it.
- The ranks that answered give one UNKNOWN result per phase they stopped in (which phase and
  checks, which ranks and nodes, how long into it, under which ``--timeout``), blamed on no
  node: a collective that all its ranks failed together says the timeout was too short for
  this machine, not which node is at fault. Where every one of them had finished the phase and
  stored its figures (`runner._stored`; the exchange with rank 0 after it failed), the phase
  is not among what was not measured: its results are in the report.
- The figures measured before the stop are judged as in a whole run, but they were measured
  once: a flagged one keeps its status and excludes no node (`evidence.blamed: false`), since
  a node is excluded only for a figure slow twice (recheck.py) and the re-check never ran.
"""

from __future__ import annotations

from typing import Callable

from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult, PreflightReport
from mscale.hostlist import collect_hostlist
from mscale.preflight import judge
from mscale.preflight.report import (finish, judged_measurements, measured_figures, on_gpu,
                                     skew_results)

PHASE_CHECKS = {"start": "clock skew", "groups": "the TP/PP/DP groups", "compute": "gemm",
                "p2p": "p2p", "collectives": "allreduce, allgather, reduce_scatter",
                "host": "host checks", "recheck": "the re-check of suspects"}
"""Each phase of a rank (runner.PHASES, in order) and the checks it measures."""
ORDER = list(PHASE_CHECKS)


def failure_report(plan: Plan, opts, payloads: list[dict], stops: dict[int, dict],
                   lost: list[int],
                   node_of_rank: Callable[[int], str | None]) -> PreflightReport:
    """Rank 0, after a failed collective: ``payloads``, every rank's figures so far;
    ``stops``, rank → what it saw (`runner.stop_record`: phase, after_s, error), rank 0's
    included; ``lost``, the ranks that never answered."""
    world = plan.layout.world_size
    known = {p["rank"]: p["node"] for p in payloads if "node" in p}
    node_of = {r: known.get(r) or node_of_rank(r) or "?" for r in range(world)}
    measured = [p for p in payloads if "rank" in p]
    before = measured_before(plan, measured)
    results = before + stop_results(stops, lost, node_of, opts.timeout_s)
    results += lost_results(lost, stops.get(0, {}), node_of, opts.timeout_s)
    report = finish(plan, opts, world, results, node_of)
    for r in before:
        if r.evidence.get("measured_once"):  # after finish: blame_links words the message too
            r.message += ("; measured once (the preflight stopped before the re-check): no "
                          "node is excluded for it")
    report.measured = measured_figures(before, measured)
    report.judging = {**judge.tolerance_for(on_gpu(measured)).as_record(), "rechecked": 0,
                      "cleared": 0}
    return report


def measured_before(plan: Plan, payloads: list[dict]) -> list[CheckResult]:
    """What the ranks measured before the stop, judged as in a whole run; a flagged GEMM or
    link figure is marked measured once and not blamed."""
    results = judged_measurements(plan, payloads)
    for r in results:
        if r.status != "OK":
            r.evidence.update(measured_once=True, blamed=False)
            # the whole run's advice; failure_report says why it does not hold here
            r.message = r.message.replace("; exclude its node", "")
    results += skew_results(payloads)
    for p in payloads:
        results += [CheckResult.model_validate(r) for r in p.get("host", [])]
    return results


def stop_results(stops: dict[int, dict], lost: list[int], node_of: dict[int, str],
                 timeout_s: float) -> list[CheckResult]:
    """One UNKNOWN result per phase the answering ranks stopped in, blamed on no node."""
    by_phase: dict[str, list[int]] = {}
    for rank, stop in sorted(stops.items()):
        by_phase.setdefault(stop.get("phase", "start"), []).append(rank)
    out = []
    for phase, ranks in sorted(by_phase.items(), key=lambda kv: _index(kv[0])):
        seen = [stops[r] for r in ranks]
        timed_out = any("timed out" in s.get("error", "").lower() or
                        "timeout" in s.get("error", "").lower() for s in seen)
        afters = [s["after_s"] for s in seen if s.get("after_s") is not None]
        # every rank had stored the phase's figures: the exchange with rank 0 after it failed
        finished = all(s.get("finished") for s in seen)
        not_measured = [PHASE_CHECKS[p] for p in ORDER[_index(phase) + finished:]
                        if p not in ("start", "groups")]
        nodes = collect_hostlist(sorted({node_of[r] for r in ranks}))
        how = f"timed out (--timeout {timeout_s:g} s)" if timed_out else "failed"
        into = (f", {max(afters):.1f} s {'after it began' if finished else 'into the phase'}"
                if afters else "")
        blame = ("the rank(s) that never answered are named by rank_alive" if lost else
                 "every rank answered: no node is blamed")
        what = f"'{phase}' ({PHASE_CHECKS.get(phase, phase)})"
        if finished:
            what += " finished; the exchange with rank 0 after it"
        msg = (f"{what} {how} on rank(s) {spans(ranks)} "
               f"({nodes}){into}; rank {ranks[0]} saw {seen[0].get('error', 'no error text')}; "
               f"{blame}; not measured: {'; '.join(not_measured)}")
        if timed_out:
            msg += "; on a slow or busy machine run again with a longer --timeout"
        out.append(CheckResult(
            check="stopped", entity_kind="job", entity=f"phase {phase}", ranks=ranks,
            status="UNKNOWN", expected=f"'{phase}' completes, each collective within "
                                       f"--timeout {timeout_s:g} s", message=msg,
            evidence={"phase": phase, "nodes": nodes, "timeout_s": timeout_s,
                      "after_s": max(afters) if afters else None, "timed_out": timed_out,
                      "error": seen[0].get("error"), "not_measured": not_measured}))
    return out


def lost_results(lost: list[int], seen: dict, node_of: dict[int, str],
                 timeout_s: float) -> list[CheckResult]:
    """CRITICAL ``rank_alive`` for each rank that never answered, blamed on its node."""
    phase = seen.get("phase", "start")
    return [CheckResult(check="rank_alive", entity_kind="rank", entity=f"rank {r}",
                        node=None if node_of[r] == "?" else node_of[r], ranks=[r],
                        status="CRITICAL",
                        expected=f"finishes '{phase}' within {timeout_s:g} s",
                        message=f"rank {r} never finished '{phase}' nor said it failed (dead, "
                                f"hung, or could not start); rank 0 saw: "
                                f"{seen.get('error', 'no error text')}")
            for r in lost]


def _index(phase: str) -> int:
    return ORDER.index(phase) if phase in ORDER else 0


def spans(ranks: list[int]) -> str:
    """``0-3,6`` for ranks 0, 1, 2, 3, 6: one line names thousands of ranks."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)
