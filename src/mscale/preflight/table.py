"""The preflight report as the operator reads it: the table (failures first), one line per
failure, the tolerance it was judged with, the status and the exclude line; or the JSON.

Kept apart from report.py, which builds the report: this module only words it."""

from __future__ import annotations

from mscale.config.preflight import CheckResult, PreflightReport
from mscale.preflight import judge


def render(report: PreflightReport, as_json: bool) -> None:
    """The table (NODE · RANK · CHECK · VALUE · EXPECTED · STATUS) and the exclude line, or JSON."""
    import json
    import sys

    if as_json:
        sys.stdout.write(json.dumps(report.model_dump(mode="json"), indent=2) + "\n")
        sys.stdout.flush()
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colour = {"OK": "green", "WARNING": "yellow", "CRITICAL": "red", "UNKNOWN": "magenta"}
    title = f"preflight ({report.level}, world {report.world})"
    table = Table(title=title)
    for col in ("NODE", "RANK", "CHECK", "ENTITY", "VALUE", "EXPECTED", "STATUS"):
        table.add_column(col, overflow="fold")
    shown, folded = table_rows(report.results)
    for r in shown:
        value = "-" if r.value is None else f"{r.value:.4g} {r.unit}"
        table.add_row(*(escape(x) for x in (
            r.node or "", ",".join(map(str, r.ranks)) if len(r.ranks) <= 4 else
            f"{len(r.ranks)} ranks", r.check, r.entity, value, r.expected)),
            f"[{colour[r.status]}]{r.status}[/]")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)

    def say(line: str) -> None:
        """One line whatever its length: cut at 200 columns off a terminal, a line's end went
        to a line of its own in a batch log (`... keep every` / `one`), out of a grep's reach."""
        console.print(line, markup=False, soft_wrap=True)

    if shown:
        console.print(table)
    else:  # a healthy job past SHOWN_OK (the CPU demo's 8 ranks already): no empty frame
        say(f"{title}: no failure to list")
    if folded:
        say(folded)
    for line in failure_lines(report.results):
        say(line)
    j = report.judging
    if j:
        again = (f"; {j['rechecked']} suspect(s) measured again, {j['cleared']} cleared"
                 if j.get("rechecked") else "")
        say(f"judged with the {j['name']} tolerance (below {j['device_warn']:g} x the peers' "
            f"median for GEMM, {j['link_warn']:g} for links, critical below {j['critical']:g}: "
            f"{j['why']}){again}")
    say(f"status {report.status}; bad nodes: {report.exclude or 'none'}")
    if report.exclude:
        say(f"exclude: sbatch --exclude={report.exclude}")


SHOWN_OK = 64
"""OK results the table lists: all of a small job's. A job of 12,288 ranks has tens of thousands
(a GEMM per rank, a line per link), which would bury the failures in a batch log; past this many
the table lists none of them, and one line under it counts them by check."""


def table_rows(results: list[CheckResult]) -> tuple[list[CheckResult], str]:
    """The results the table lists, failures first, and the line that stands for the OK ones it
    leaves out ("" when it lists every one). The JSON and preflight.json keep every result."""
    ordered = sorted(results, key=lambda r: (-judge.SEVERITY[r.status], r.check, r.entity))
    ok = [r for r in ordered if r.status == "OK"]
    if len(ok) <= SHOWN_OK:
        return ordered, ""
    counts: dict[str, int] = {}
    for r in ok:
        counts[r.check] = counts.get(r.check, 0) + 1
    by_check = ", ".join(f"{check} {n:,}" for check, n in sorted(counts.items()))
    return ([r for r in ordered if r.status != "OK"],
            f"OK: {len(ok):,} results not listed ({by_check}); --json and preflight.json keep "
            "every one")


def failure_lines(results: list[CheckResult]) -> list[str]:
    """One line per failure, except that the slow links (pairs, groups) blamed on the same node
    share one line, naming them by check: a node with a degraded NIC is slow on every link it
    is on, and twenty lines that each end "node3 is at fault" hide the one thing to do. The
    table and the JSON keep every result."""
    order: list[CheckResult | tuple[str, str]] = []  # a result, or a (status, node) of links
    links: dict[tuple[str, str], list[CheckResult]] = {}
    for r in results:
        if r.status == "OK":  # UNKNOWN too: what could not be measured, and why
            continue
        if not (r.node and r.entity_kind in ("pair", "group")):
            order.append(r)
            continue
        key = (r.status, r.node)
        if key not in links:
            links[key] = []
            order.append(key)
        links[key].append(r)
    lines = []
    for item in order:
        if isinstance(item, tuple) and len(links[item]) > 1:
            lines.append(_node_line(*item, links[item]))
            continue
        r = links[item][0] if isinstance(item, tuple) else item
        lines.append(f"{r.status}: {r.check} {r.entity} ({r.node or 'no single node'}): "
                     f"{r.message}")
    return lines


def _node_line(status: str, node: str, links: list[CheckResult]) -> str:
    """``CRITICAL: node3 is at fault: ... (15 links, ...): p2p 4-5, 4-6; allreduce tp[4,5]``."""
    checks: dict[str, list[str]] = {}
    for r in links:
        checks.setdefault(r.check, []).append(r.entity)
    named = "; ".join(f"{check} {', '.join(entities)}" for check, entities in checks.items())
    fracs = [r.evidence["fraction_of_median"] for r in links
             if r.evidence.get("fraction_of_median") is not None]
    notes = [f"{len(links)} links"]
    if fracs:
        notes.append(f"down to {min(fracs):.2g} x their peers' median")
    if all(r.evidence.get("rounds") for r in links):
        notes.append("slow in both rounds")
    if cut := sum(1 for r in links if r.evidence.get("cut_short")):
        notes.append(f"{cut} cut short")
    why = ("its links inside the node are slow"
           if all(r.evidence.get("blame") == "inside_node" for r in links)
           else "its rank(s) slow on every peer set")
    verdict = "is at fault"
    if all(r.evidence.get("measured_once") for r in links):  # a stopped preflight's figures
        verdict = "looks at fault"
        notes.append("measured once (the preflight stopped before the re-check): no node is "
                     "excluded for them")
    return f"{status}: {node} {verdict}, {why} ({', '.join(notes)}): {named}"
