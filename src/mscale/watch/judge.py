"""The judge: runs every rule row by row and keeps each finding open until it clears.

``Watcher.feed(window)`` takes the rows a `MetricsFeed` just delivered and returns only *new*
findings: one that is already open is updated in place (its last step, evidence and what-if),
not emitted again, so an event log gets one line per problem rather than one per step. A finding
closes after its rule has judged ``clear_steps`` rows without seeing it; if it comes back later
it is a new finding. ``check_hang`` is called by the follower between polls.

Rows are judged in order and each rule sees only the past, so ``--once`` over a finished run
finds what a live watch would have found, at the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mscale.errors import MscaleError
from mscale.watch.config import WatchConfig
from mscale.watch.detect.imbalance import judge_imbalance
from mscale.watch.detect.joblevel import JobLevel
from mscale.watch.detect.links import LinkRows, LinkRules
from mscale.watch.detect.rows import Masker, Rows
from mscale.watch.detect.straggler import StragglerRules
from mscale.watch.detect.training import TrainingRules
from mscale.watch.findings import Finding
from mscale.watch.layout import JobLayout
from mscale.watch.whatif import Grid, WhatIf, estimate_micro_batches
from mscale.watch.window import PER_RANK, REQUIRED_PER_RANK, Window

SEVERITY = {"ok": 0, "info": 1, "warning": 2, "critical": 3}


@dataclass
class _Open:
    finding: Finding
    absent: int = 0


def _family(f: Finding) -> str:
    """The key of ``found`` whose rule owns ``f``: a rule that did not run on a row (the rank
    rules skip masked rows) must not count its findings as gone."""
    return "link" if f.cause == "slow_link" else f.kind


class Watcher:
    """Judges one run (one layout)."""

    def __init__(self, layout: JobLayout, config: WatchConfig | None = None):
        self.layout, self.cfg = layout, config or WatchConfig()
        self.grid = Grid(layout)
        cfg = self.cfg
        cap = max(cfg.persist_steps, cfg.imbalance_window, cfg.job_window, cfg.baseline_steps)
        self.rows = Rows(self.grid, cfg, cap)
        self.link_rows = LinkRows(self.grid, cfg.persist_steps)
        self.links = LinkRules(self.grid, cfg)
        self.masker = Masker(cfg)
        self.training = TrainingRules(cfg)
        self.stragglers = StragglerRules(self.grid, cfg)
        self.job = JobLevel(self.grid, cfg)
        self.micro_batches: float | None = cfg.micro_batches or layout.micro_batches
        self._open: dict[tuple, _Open] = {}
        self.emitted: dict[str, int] = {}
        """Findings emitted so far, by kind."""
        self.worst = "ok"
        """Worst severity of any finding emitted so far."""
        self.escalated: list[Finding] = []
        """Open findings whose severity rose during the last `feed` (recorded once more)."""
        self.cleared: list[Finding] = []
        """Findings that closed during the last `feed` (recorded as cleared: a reader of
        events.jsonl, recover among them, tells what is still wrong from what was)."""
        self.last_step: int | None = None
        self.judged = 0

    # -- feeding --------------------------------------------------------------------------

    def feed(self, window: Window) -> list[Finding]:
        """New findings from the rows of ``window`` (oldest first)."""
        if len(window) and window.world != self.layout.world:
            raise MscaleError(
                f"the metrics have {window.world} ranks per record, the layout "
                f"{self.layout.tp}x{self.layout.pp}x{self.layout.dp} has {self.layout.world}",
                field="--tp/--pp/--dp", fix="give the layout the job ran with (or its plan.yaml)")
        new: list[Finding] = []
        self.escalated, self.cleared = [], []
        for i in range(len(window)):
            new += self._row(window, i)
        return new

    def _row(self, win: Window, i: int) -> list[Finding]:
        step = int(win.steps[i])
        if self.masker.restarted(step):
            self.rows.clear()
            self.link_rows.clear()
            self.training.restarted()
        self.last_step = step
        ranks = win.ranks[i]
        finite = bool(np.isfinite(ranks[:REQUIRED_PER_RANK]).all())  # link vectors optional
        found: dict[str, list[Finding]] = {}
        nan = self.training.nan(step, {"loss": float(win.scalar("loss")[i]),
                                       "grad_norm": float(win.scalar("grad_norm")[i])}, finite)
        found["nan"] = [nan] if nan else []
        compute, wait = ranks[1], ranks[2] + ranks[4]
        data, bubble = ranks[3], ranks[4]
        own_median = float(np.median(compute + data)) if finite else math.nan
        extra = win.extra[i] if i < len(win.extra) else None
        why = self.masker.reason(own_median, extra)
        if why != "warmup":
            spike = self.training.grad_spike(step, float(win.scalar("grad_norm")[i]))
            div = self.training.divergence(step, float(win.scalar("loss")[i]))
            found["grad_spike"] = [spike] if spike else []
            found["divergence"] = [div] if div else []
        if why != "warmup" and finite:
            found["link"] = self._links(ranks)
        if why is None and finite:
            self.judged += 1
            step_time = float(ranks[0].max())
            self.rows.append(step, compute, data, wait, bubble, step_time,
                             float(win.scalar("tokens_per_s")[i]))
            found.update(self._judge_rows())
        return self._reconcile(step, found)

    def _links(self, ranks: np.ndarray) -> list[Finding]:
        """The slow-link rule sees every row after warm-up, spikes included: it compares groups
        within a row, so a job-wide pause moves every group alike, and the onset of a slow link
        (which slows every rank at once) is exactly what the spike mask hides for a while."""
        links = {k: ranks[PER_RANK.index(f"comm_{k}")] for k in self.link_rows.sources()}
        if not all(np.isfinite(v).all() for v in links.values()):
            self.link_rows.clear()  # a record without the split (another trainer's)
            return []
        # what each rank did itself (its step less its waits): a pipeline pair that waits on a
        # late rank elsewhere in its pipeline is no link (detect/links.py: explained_pairs)
        active = ranks[0] - ranks[2] - ranks[4]
        self.link_rows.append(self.last_step, float(ranks[0].max()), links, active)
        if self.link_rows.n < self.cfg.persist_steps:
            return []
        own = self.rows.last(self.cfg.persist_steps).own if self.rows.n else None
        whatif = WhatIf(self.grid, self.micro_batches or 1.0)
        return self.links.judge(self.link_rows, own, whatif)

    def _judge_rows(self) -> dict[str, list[Finding]]:
        cfg = self.cfg
        out: dict[str, list[Finding]] = {}
        if self.job.baseline is None and self.rows.n >= cfg.baseline_steps:
            base = self.rows.last(cfg.baseline_steps)
            self.job.set_baseline(base)
            if self.micro_batches is None:
                self.micro_batches = estimate_micro_batches(base.own, base.bubble, self.grid)
        if self.rows.n < cfg.persist_steps:
            return out
        w = self.rows.last(cfg.persist_steps)
        m = self.micro_batches or estimate_micro_batches(w.own, w.bubble, self.grid) or 1.0
        whatif = WhatIf(self.grid, m)
        stragglers = self.stragglers.judge(w, whatif, self.job.stage_excess)
        imb = judge_imbalance(self.rows.last(cfg.imbalance_window), self.grid, cfg, whatif)
        if imb or any(o.finding.cause == "data_imbalance" for o in self._open.values()):
            # a replica that happened to be slow in most of the last few steps is chance while
            # the slow replica moves; a persistently slow one ends the imbalance (its share)
            stragglers = [f for f in stragglers if f.cause not in ("slow_device", "slow_node")]
        stragglers += [imb] if imb else []
        out["straggler"] = stragglers
        if self.job.baseline is not None:
            keys = {f.key for f in stragglers}
            known = stragglers + [o.finding for o in self._open.values()
                                  if o.finding.kind == "straggler" and o.finding.key not in keys]
            job = self.job.judge(self.rows.last(cfg.job_window), known)
            out["straggler"] += [f for f in job if f.kind == "straggler"]
            out["throughput"] = [f for f in job if f.kind == "throughput"]
        return out

    def _reconcile(self, step: int, found: dict[str, list[Finding]]) -> list[Finding]:
        """Open the new, refresh the known, close what its rule no longer sees."""
        new, seen = [], set()
        for kind, findings in found.items():
            for f in findings:
                self._grade(f)
                seen.add(f.key)
                known = self._open.get(f.key)
                if known is None:
                    f.evidence.setdefault("detected_at", step)
                    self._open[f.key] = _Open(f)
                    new.append(f)
                    self.emitted[f.kind] = self.emitted.get(f.kind, 0) + 1
                    if SEVERITY[f.severity] > SEVERITY[self.worst]:
                        self.worst = f.severity
                else:
                    self._refresh(known, f)
        for key, o in list(self._open.items()):
            if _family(o.finding) in found and key not in seen:
                o.absent += 1
                if o.absent >= self.cfg.clear_steps:
                    del self._open[key]
                    self.cleared.append(o.finding)
        return new

    def _grade(self, f: Finding) -> None:
        """A sick device, node or link, or a job-wide slowdown, that costs at least
        ``critical_slowdown_pct`` is critical (config.py, findings.COSTLY_CAUSES); each is priced
        on the rows since its onset (detect/)."""
        if f.graded_by_cost and (f.slowdown_pct or 0.0) >= self.cfg.critical_slowdown_pct \
                and SEVERITY[f.severity] < SEVERITY["critical"]:
            f.severity = "critical"
            f.evidence["critical_slowdown_pct"] = self.cfg.critical_slowdown_pct

    def _refresh(self, known: _Open, f: Finding) -> None:
        """An open finding seen again: its figures, message and evidence follow the newest
        window (a slow link's cost is measured again each row, detect/links.py), its severity
        only rises (``escalated_at`` in its evidence says when), and it is not emitted again."""
        old = known.finding
        known.absent = 0
        f.evidence["detected_at"] = old.evidence.get("detected_at")
        for k in ("escalated_at", "escalated_from"):
            if k in old.evidence:
                f.evidence[k] = old.evidence[k]
        old.last_step, old.slowdown_pct = f.last_step, f.slowdown_pct
        if old.kind not in ("nan", "grad_spike"):  # their message names the first bad step
            old.message, old.evidence, old.advice = f.message, f.evidence, f.advice
        if SEVERITY[f.severity] > SEVERITY[old.severity]:
            old.evidence.update(escalated_from=old.severity, escalated_at=f.last_step)
            old.severity = f.severity
            if not any(o is old for o in self.escalated):
                self.escalated.append(old)
            if SEVERITY[old.severity] > SEVERITY[self.worst]:
                self.worst = old.severity

    # -- hang -------------------------------------------------------------------------------

    def hang_limit(self) -> float:
        """Seconds without a record that make a hang (config.py: hang_*)."""
        cfg = self.cfg
        if cfg.hang_s is not None:
            return cfg.hang_s
        ref = self.job.baseline["step"] if self.job.baseline else None
        if ref is None and self.rows.n:
            ref = float(np.median(self.rows.last(self.rows.n).step_time))
        ref = ref or cfg.expected_step_s
        if not ref:
            return cfg.hang_startup_s
        return max(cfg.hang_min_s, cfg.hang_factor * ref)

    def check_hang(self, now: float, last_record_time: float | None,
                   attempt_start: float | None = None) -> list[Finding]:
        """A hang finding when no record came for `hang_limit` seconds (once per hang).

        ``attempt_start``: the newest attempt started after the last record (a relaunch that
        has not finished its first step). Its silence counts from its start, and it is given
        the startup allowance (``hang_startup_s``: loading a checkpoint, compiling): measured
        from the previous attempt's last record with that attempt's step time, a relaunch
        still loading was called a stuck job."""
        if last_record_time is None:
            return []
        idle, limit = now - last_record_time, self.hang_limit()
        after = f"after step {self.last_step}"
        if attempt_start is not None and attempt_start > last_record_time:
            idle = now - attempt_start  # an explicit --hang-s still stands
            limit = limit if self.cfg.hang_s is not None else max(limit, self.cfg.hang_startup_s)
            after = f"since the newest attempt started (resuming after step {self.last_step})"
        found = []
        if idle > limit:
            found = [Finding(
                kind="hang", severity="critical", first_step=self.last_step,
                last_step=self.last_step,
                message=f"no new metrics for {idle:.0f} s (limit {limit:.0f} s) {after}: "
                        "the job is stuck",
                evidence={"rule": "no new record for longer than the hang limit",
                          "idle_s": idle, "limit_s": limit, "last_step": self.last_step},
                advice="look for the rank that stopped (logs/rank<N>.log, py-spy dump); halt "
                       "and resume from the last checkpoint")]
        key = ("hang", "none", (), ())
        if not found and key in self._open:
            del self._open[key]
            return []
        return self._reconcile(self.last_step or 0, {"hang": found}) if found else []

    # -- state ------------------------------------------------------------------------------

    def open_findings(self) -> list[Finding]:
        return [o.finding for o in self._open.values()]

    def summary(self) -> dict:
        """Worst severity, counts, the baseline and the slowest ranks and nodes right now."""
        open_ = self.open_findings()
        worst_open = max((f.severity for f in open_), key=SEVERITY.get, default="ok")
        out = {"worst": self.worst, "worst_open": worst_open, "emitted": dict(self.emitted),
               "open": len(open_), "last_step": self.last_step, "judged_rows": self.judged,
               "masked_rows": dict(self.masker.counts),
               "baseline_step_s": self.job.baseline["step"] if self.job.baseline else None,
               "baseline_tokens_per_s": self.job.baseline["tokens_per_s"]
               if self.job.baseline else None,
               "micro_batches": self.micro_batches, "slowest_ranks": [], "slowest_nodes": []}
        excess = getattr(self.stragglers, "excess", None)
        if excess is not None:
            g = self.grid
            top = np.argsort(-excess)[:5]
            out["slowest_ranks"] = [{"rank": int(r), "node": g.name(int(g.node[r])),
                                     "excess_s": float(excess[r])} for r in top]
            per_node = np.bincount(g.node, weights=excess, minlength=g.nodes) / np.maximum(
                g.node_size, 1)
            out["slowest_nodes"] = [{"node": g.name(int(n)), "excess_s": float(per_node[n])}
                                    for n in np.argsort(-per_node)[:5]]
        return out
