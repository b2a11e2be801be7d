"""Re-check suspect nodes before keeping them out: a node that failed once may be healthy.

Why: excluding a node on one crash costs a node for the rest of the run; relaunching on a bad
one costs another failure. Preflight measures the difference. What counts, in order:

1. a ``preflight.json`` written after the failure (by its own ``time``: one without is of unknown
   age), for this run's plan (its world and layout): a node it measured and names in
   ``bad_nodes`` fails with that check's message; a node it measured without fault is healthy;
2. under SLURM, SLURM's own word first: a node ``sinfo`` reports down, drained or not
   responding fails at once (srun would wait a minute for it, then fail the whole job). Then
   preflight run now (``srun --nodelist=<the job's nodes> ... mscale preflight --json``):
   preflight judges a node against its peers and needs the plan's world, so the suspects are
   measured together with the job's other nodes. A preflight job that fails without a report
   says nothing about one node (a rendezvous or the queue fails the whole job), so its
   suspects are left to the evidence, with a note;
3. otherwise (``--local``: every "node" is this machine; torchrun: recover cannot start
   processes on other machines) the node is *not re-checked*, and a note says so.

`Rechecker` is the ``recheck`` callable `recover.exclude.decide_exclusions` takes: node → failure
reason, or None when healthy; nodes it could not re-check are absent from the answer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mscale.config.plan import Plan
from mscale.config.preflight import PreflightReport
from mscale.hostlist import collect_hostlist
from mscale.recover.diagnose.read import JSONL_TAIL_BYTES, METRICS_TAIL_BYTES, read_jsonl_tail
from mscale.recover.exclude import report_time
from mscale.recover.relaunch import Launch
from mscale.runs.atomic import fs_and_path
from mscale.runs.rundir import RunDir

Srun = Callable[[list[str], float], tuple[int, str, str]]
"""Runs srun (or sinfo): (argv, timeout) → (exit code, stdout, stderr). Injected by tests."""

BAD_STATES = ("down", "drain", "fail", "not_responding", "no_respond", "maint", "reboot")
"""SLURM node states (``sinfo %T``) that mean the node cannot run the job; a trailing ``*``
(not responding) counts too."""

SINFO_TIMEOUT_S = 20.0
"""Longest ``sinfo`` may take (SLURM's word on the job's nodes, before preflight)."""

RECHECK_TIMEOUT_S = 300.0
"""Longest a SLURM re-check may take: start-up on every node plus a quick preflight (about ten
seconds at world 8 on CPUs, docs/preflight.md) with room for a busy queue."""


def failure_time(run: RunDir) -> float:
    """When the last attempt stopped: its stop/hang/nan event, else its last metrics record,
    else its start; 0 when the run recorded nothing. Read from the files' tails, as the
    diagnosis reads them (a bad line skipped): a 12,288-rank run's metrics.jsonl holds ~1.9 MB
    a step, and reading it whole took minutes and as many GB for one timestamp."""
    events, _ = read_jsonl_tail(run.events, JSONL_TAIL_BYTES)
    events = [e for e in events if isinstance(e, dict)]
    starts = [i for i, e in enumerate(events) if e.get("kind") == "start"
              and e.get("source", "train") == "train"]
    after = events[starts[-1]:] if starts else events
    ends = [_time(e) for e in after if e.get("kind") in ("stop", "hang", "nan")]
    if ends:
        return ends[-1]
    metrics = [m for m in read_jsonl_tail(run.metrics, METRICS_TAIL_BYTES)[0]
               if isinstance(m, dict)]
    if metrics:
        return _time(metrics[-1])
    return _time(after[0]) if after else 0.0


def _time(record: dict) -> float:
    t = record.get("time", 0.0)
    return float(t) if isinstance(t, (int, float)) else 0.0


def read_report(url: str, notes: list[str] | None = None) -> PreflightReport | None:
    """The preflight report at ``url``; None when there is none, or when it is not a report
    (then said in ``notes``: a damaged file must not pass for a missing one unremarked)."""
    fs, path = fs_and_path(url)
    if not fs.isfile(path):
        return None
    try:
        return PreflightReport.model_validate_json(fs.cat_file(path))
    except ValueError as e:
        if notes is not None:
            notes.append(f"{url} is not a preflight report, not used: "
                         f"{str(e).splitlines()[0]}")
        return None


def judge_report(report: PreflightReport, nodes: list[str]) -> dict[str, str | None]:
    """What one preflight report says about ``nodes``: a reason for each bad node, None for
    each node it measured without fault; nodes it never measured are absent."""
    out: dict[str, str | None] = {}
    for node in nodes:
        mine = [r for r in report.results if r.node == node]
        if not mine:  # bad_nodes also lists quarantined nodes the job never ran on
            continue
        if node in report.bad_nodes:
            bad = [r for r in mine if r.status == "CRITICAL"] or mine
            out[node] = f"preflight re-check failed ({bad[0].check}: {bad[0].message})"[:300]
        else:
            out[node] = None
    return out


def _same_plan(report: PreflightReport, plan: Plan) -> bool:
    layout = {k: getattr(plan.layout, k) for k in ("tp", "pp", "dp")}
    return report.world == plan.layout.world_size and \
        all(report.layout.get(k) == v for k, v in layout.items())


def _srun(argv: list[str], timeout: float) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s"
    except OSError as e:
        return 127, "", str(e)
    return p.returncode, p.stdout, p.stderr


def _progress(line: str) -> None:
    """A re-check takes seconds to minutes: say so on stderr (``--json`` keeps stdout one
    document)."""
    print(f"recover: {line}", file=sys.stderr, flush=True)


def _json_document(text: str) -> dict | None:
    """The JSON document rank 0 printed with ``--json`` (other ranks may print lines too)."""
    start = text.find("{")
    while start != -1:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.find("\n{", start + 1)
            start = start + 1 if start != -1 else -1
    return None


@dataclass
class Rechecker:
    """Re-checks suspect nodes (see the module docstring); callable as ``recheck(nodes)``."""

    run: RunDir
    plan: Plan
    plan_path: str
    launch: Launch | None
    since: float
    """Failure time: only a preflight.json newer than this counts."""
    srun: Srun = _srun
    timeout_s: float = RECHECK_TIMEOUT_S
    notes: list[str] = field(default_factory=list)
    """What the operator should know (nodes not re-checked and why), one sentence each."""
    answers: dict[str, str | None] = field(default_factory=dict)
    """Every answer given so far."""
    progress: Callable[[str], None] = _progress
    """Told a line before and after each re-check that runs something (stderr by default)."""
    clock: Callable[[], float] = time.monotonic

    def __call__(self, nodes: list[str]) -> dict[str, str | None]:
        todo = sorted(set(nodes))
        out: dict[str, str | None] = {}
        report = read_report(self.run.preflight, self.notes)
        if report is not None and (report_time(report) or 0.0) > self.since and \
                _same_plan(report, self.plan):
            out.update(judge_report(report, todo))
        todo = [n for n in todo if n not in out]
        if todo:
            out.update(self._measure(todo))
        self.answers.update(out)
        return out

    def _measure(self, nodes: list[str]) -> dict[str, str | None]:
        launch = self.launch
        hosts = collect_hostlist(nodes)
        if launch is None or not (launch.slurm or launch.launcher == "slurm"):
            where = ("under --local every node is this machine" if launch is not None and
                     launch.local else "recover can start preflight only through SLURM")
            self.notes.append(f"{hosts} not re-checked: {where}; the evidence alone decides")
            return {}
        if shutil.which("srun") is None and self.srun is _srun:
            self.notes.append(f"{hosts} not re-checked: srun is not on PATH here")
            return {}
        self.progress(f"re-checking {hosts} with preflight (up to "
                      f"{2 * SINFO_TIMEOUT_S + self.timeout_s:.0f} s) …")
        began = self.clock()
        found = self._srun_preflight(nodes, launch)
        said = "; ".join(f"{n}: {'healthy' if found[n] is None else found[n]}"
                         for n in nodes if n in found) or "no answer (see the notes)"
        self.progress(f"re-check of {hosts} done in {self.clock() - began:.1f} s: {said}")
        return found

    def _srun_preflight(self, nodes: list[str], launch: Launch) -> dict[str, str | None]:
        world = self.plan.layout.world_size
        job_nodes = launch.nodes or nodes
        per_node = max(1, world // max(1, len(job_nodes)))
        if per_node * len(job_nodes) != world:
            self.notes.append(f"{collect_hostlist(nodes)} not re-checked: the job's "
                              f"{len(job_nodes)} nodes do not hold the plan's {world} ranks")
            return {}
        down = self._down(job_nodes)
        if down:  # srun cannot start on the job's nodes: answer from SLURM's own word
            others = [n for n in nodes if n not in down]
            if others:
                self.notes.append(f"{collect_hostlist(others)} not re-checked: "
                                  f"{collect_hostlist(sorted(down))} cannot run preflight")
            return {n: why for n, why in down.items() if n in nodes}
        exe = launch.argv[0] if launch.argv and "mscale" in os.path.basename(launch.argv[0]) \
            else "mscale"
        with tempfile.TemporaryDirectory(prefix="mscale-recheck-") as tmp:
            argv = ["srun", f"--nodelist={collect_hostlist(job_nodes)}",
                    f"--nodes={len(job_nodes)}", f"--ntasks={world}",
                    f"--ntasks-per-node={per_node}", "--immediate=60",
                    exe, "preflight", self.plan_path, "--run-dir", tmp, "--json",
                    "--timeout", "60"]
            if launch.slurm and launch.slurm.get("job_name"):
                argv[1:1] = [f"--job-name={launch.slurm['job_name']}-recheck"]
            code, out, err = self.srun(argv, self.timeout_s)
            doc = _json_document(out)
            report = None
            if doc is not None and "results" in doc:
                try:
                    report = PreflightReport.model_validate(doc)
                except ValueError as e:
                    self.notes.append(f"the re-check's report could not be read: "
                                      f"{str(e).splitlines()[0]}")
            else:
                report = read_report(os.path.join(tmp, "preflight.json"), self.notes)
        if report is None:
            return self._srun_failed(nodes, code, err)
        found = judge_report(report, nodes)
        for n in nodes:
            if n not in found:
                self.notes.append(f"{n}: the re-check measured nothing on it")
        return found

    def _down(self, nodes: list[str]) -> dict[str, str]:
        """Nodes SLURM itself reports down, drained or not responding (``sinfo``), with why."""
        rc, out, _ = self.srun(["sinfo", "-h", "-N", "-n", collect_hostlist(nodes),
                                "-o", "%N %T"], SINFO_TIMEOUT_S)
        if rc != 0:
            return {}
        states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
        return {n: f"preflight could not run on it: SLURM reports it {s}"
                for n, s in ((n, states.get(n, "").lower()) for n in nodes)
                if s.endswith("*") or any(b in s for b in BAD_STATES)}

    def _srun_failed(self, nodes: list[str], code: int, err: str) -> dict[str, str | None]:
        """No report came back. srun fails for the whole job (a rendezvous, the queue) as often
        as for one node, so a node fails the re-check only when SLURM itself says it is down,
        drained or not responding; the others are left to the evidence, with a note."""
        last = (err.strip().splitlines() or [f"exit {code}"])[-1][:200]
        found: dict[str, str | None] = dict(self._down(nodes))
        rest = [n for n in nodes if n not in found]
        if rest:
            self.notes.append(f"{collect_hostlist(rest)} not re-checked: the preflight job "
                              f"failed (srun exit {code}: {last})")
        return found
