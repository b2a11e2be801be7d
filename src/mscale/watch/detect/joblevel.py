"""The job against its own baseline: job-wide slowdowns and throughput regressions.

The baseline is the first ``baseline_steps`` judged rows after warm-up: the run's own step time,
tokens/s, busy/wait/data medians and the compute of each pipeline stage. A cluster has no
universal "good" step time; the run itself is the reference.

- job-wide: the windowed step time is ``job_wide_rel`` above the baseline beyond what the open
  rank/node/stage findings explain (their what-if savings), and most steps do not have one
  clearly slow replica (that is an imbalance): every rank is slower, so it is the
  network, the storage or the whole fleet, never one node. The evidence says which part of the
  step grew (busy time: clocks, thermals; wait: network; data: storage).
- throughput: tokens/s ``throughput_rel`` below the baseline while no straggler finding is open
  and no imbalance is building up (e.g. a trainer that reports no split, or fewer tokens per
  step).
"""

from __future__ import annotations

import math

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.detect.onset import onset_step
from mscale.watch.detect.rows import Recent, median
from mscale.watch.findings import Finding
from mscale.watch.whatif import Grid


def _parts(w: Recent, rows: np.ndarray | slice = slice(None)) -> dict[str, float]:
    """Median seconds per rank of each part of the step over the window (or its ``rows``)."""
    tps = w.tokens_per_s[rows]
    return {"busy": float(median(w.compute[rows])), "wait": float(median(w.wait[rows])),
            "data": float(median(w.data[rows])),
            "step": float(median(w.step_time[rows])),
            "tokens_per_s": float(np.nanmedian(tps)) if np.isfinite(tps).any() else math.nan}


class JobLevel:
    """Baseline, then the job-wide and throughput rules."""

    def __init__(self, grid: Grid, config: WatchConfig):
        self.g, self.cfg = grid, config
        self.baseline: dict | None = None
        self.stage_excess: np.ndarray | None = None
        """Baseline compute of each stage above the median of the others (seconds)."""

    def set_baseline(self, w: Recent) -> None:
        self.baseline = _parts(w)
        g = self.g
        sc = median(g.stage_median(w.compute), axis=0)
        self.stage_excess = np.array([sc[s] - median(np.delete(sc, s)) for s in range(g.pp)]
                                     ) if g.pp > 1 else None
        self.baseline["first_step"], self.baseline["last_step"] = int(w.steps[0]), int(
            w.steps[-1])

    def judge(self, w: Recent, open_findings: list[Finding]) -> list[Finding]:
        if self.baseline is None or len(w) < self.cfg.job_window:
            return []
        base, now = self.baseline, _parts(w)
        stragglers = [f for f in open_findings if f.kind == "straggler"]
        explained = sum(float(f.evidence.get("saved_s") or 0.0) for f in stragglers
                        if f.cause != "job_wide")
        rest = now["step"] - explained
        steps = [int(w.steps[0]), int(w.steps[-1])]
        # once open, it stays open down to half the bar: a slowdown near the bar is one finding
        rel = self.cfg.job_wide_rel / (2 if any(f.cause == "job_wide" for f in stragglers) else 1)
        # most steps with one clearly slow replica is not every rank slower (imbalance.py)
        lopsided = np.mean(w.top_excess > w.top_threshold) >= self.cfg.imbalance_frac
        if rest > base["step"] * (1 + rel) and not lopsided:
            # dated by the rows that were over the bar themselves, not by the window's start
            onset = onset_step(w.steps, w.step_time - explained > base["step"] * (1 + rel))
            # priced on the rows from the onset on, as the stragglers are: found once half the
            # window is slow, its median lies midway between the healthy and the slow step
            after = w.steps >= onset
            priced = _parts(w, after)
            return [self._job_wide(base, priced, explained, priced["step"] - explained, steps,
                                   onset, int(after.sum()))]
        tps, btps = now["tokens_per_s"], base["tokens_per_s"]
        if (not stragglers and not lopsided and math.isfinite(tps) and math.isfinite(btps)
                and btps > 0
                and tps < btps * (1 - self.cfg.throughput_rel)):
            pct = 100.0 * (btps / tps - 1) if tps > 0 else math.inf
            low = w.tokens_per_s < btps * (1 - self.cfg.throughput_rel)  # NaN rows: not low
            return [Finding(
                kind="throughput", severity="warning", slowdown_pct=pct,
                message=f"throughput {tps:.4g} tokens/s is {1 - tps / btps:.0%} below this "
                        f"run's baseline of {btps:.4g}, and no straggler explains it",
                first_step=onset_step(w.steps, low), last_step=steps[1],
                evidence={"rule": "windowed tokens/s below the run's own baseline",
                          "tokens_per_s": tps, "baseline_tokens_per_s": btps,
                          "threshold_rel": self.cfg.throughput_rel, "window_steps": steps,
                          "step_s": now["step"], "baseline_step_s": base["step"]},
                advice="compare the run's configuration and inputs with the baseline's "
                       "(batch size, sequence length, data source)")]
        return []

    def _job_wide(self, base: dict, now: dict, explained: float, rest: float,
                  steps: list[int], onset: int, priced_rows: int) -> Finding:
        """``steps``: the window's first and last step; ``onset``: the first step of the rows
        that were slow themselves (the finding's first step); ``now``: the medians of the
        ``priced_rows`` rows from the onset on."""
        grew = {k: now[k] - base[k] for k in ("busy", "wait", "data")}
        part = max(grew, key=grew.get)
        where = {"busy": "compute on every rank (clocks, thermals, a co-tenant)",
                 "wait": "communication wait on every rank (the network)",
                 "data": "data loading on every rank (the storage)"}[part]
        pct = 100.0 * (rest / base["step"] - 1)
        return Finding(
            kind="straggler", severity="warning", cause="job_wide", slowdown_pct=pct,
            message=f"the whole job is {pct:.0f}% slower than its baseline "
                    f"({rest:.3g} s against {base['step']:.3g} s per step), mostly in {where}",
            first_step=onset, last_step=steps[1],
            evidence={"rule": "windowed step time above the run's baseline beyond what open "
                              "rank/node/stage findings explain",
                      "step_s": now["step"], "baseline_step_s": base["step"],
                      "explained_s": explained, "grew_s": grew, "part": part,
                      "window_steps": steps, "priced_steps": [onset, steps[1]],
                      "priced_rows": priced_rows, "saved_s": rest - base["step"],
                      "decided_by": f"{part} per rank grew by {grew[part]:.3g} s on the median "
                                    f"rank; no single rank, node or stage stands out"},
            advice=_JOB_WIDE_ADVICE[part])


_JOB_WIDE_ADVICE = {
    "busy": "look at what every rank shares (clocks, cooling, scheduler, co-located jobs); no "
            "node should be taken out for this",
    "data": "look at what every rank shares (storage, data path); no node should be taken out "
            "for this",
    # one node's NIC slows every group that crosses it, and where every group crosses every
    # node (pp 1, DP groups over all nodes) no group is slower than another: it reads as this
    "wait": "look at what every rank shares (network fabric, switches, co-located jobs), and at "
            "one node's NIC: where every DP group crosses every node (pp 1) a single degraded "
            "NIC slows them all alike, so watch names no node for it; checkpoint, stop the job "
            "and run `mscale preflight` with its plan on its nodes, which measures each link "
            "between two nodes alone and names such a node (its exclude line)"}
