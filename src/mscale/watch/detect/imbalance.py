"""Sequence-length (data) imbalance: a slow DP replica that moves from step to step.

Replicas get different samples; with variable-length sequences one replica may get more tokens
or longer attention spans in a step and every one of its ranks computes longer. No rank is slow
for long, so the windowed rank rules stay silent by design; what shows is that most steps have
one clearly slow replica, and that it is rarely the same one. Rebalancing the data (length-
aware packing or bucketing) fixes it; no node is at fault and none is named.

Per row (`Rows.append`): each rank's busy time minus the median of its DP peers, the median of
that over a replica's ranks (one rank's hiccup does not move it), the largest replica and the
bar it must pass (``step_z`` times the spread inside replicas, and ``min_excess_frac`` of the
step time).
"""

from __future__ import annotations

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.detect.onset import onset_step
from mscale.watch.detect.rows import Recent
from mscale.watch.findings import Finding
from mscale.watch.whatif import Grid, WhatIf


def judge_imbalance(w: Recent, g: Grid, cfg: WatchConfig, whatif: WhatIf) -> Finding | None:
    """A data-imbalance finding over the window ``w`` (``imbalance_window`` rows), or None."""
    if g.dp < 2 or len(w) < cfg.imbalance_window:
        return None
    slow = w.top_excess > w.top_threshold
    count = int(slow.sum())
    if count < cfg.imbalance_frac * len(w):
        return None
    replicas = np.bincount(w.top_replica[slow], minlength=g.dp)
    share = float(replicas.max()) / count
    # with few replicas a moving slow replica lands on the same one by chance: allow at least
    # 1.5x the chance share
    if share > max(cfg.imbalance_max_share, 1.5 / g.dp):
        return None
    pct, saved = whatif.slowdown(w.own, whatif.typical_all(w.compute, w.data), w.step_time)
    if pct < cfg.min_slowdown_pct:
        return None
    mean = float(np.mean(w.top_excess[slow]))
    evidence = {
        "rule": "most steps have one clearly slow DP replica, and it changes from step to step",
        "window_steps": [int(w.steps[0]), int(w.steps[-1])], "slow_steps": count,
        "replicas_seen": int((replicas > 0).sum()), "largest_share": share,
        "mean_excess_s": mean, "saved_s": saved,
        "decided_by": f"{count} of {len(w)} steps had a replica {mean:.3g} s above its peers; "
                      f"{int((replicas > 0).sum())} different replicas, none in more than "
                      f"{share:.0%} of them"}
    return Finding(kind="straggler", severity="warning", cause="data_imbalance",
                   message=f"the slowest data-parallel replica changes from step to step "
                           f"({mean:.3g} s above its peers in {count} of {len(w)} steps); "
                           f"the job is {pct:.0f}% slower because of it",
                   first_step=_onset(w, slow, cfg), last_step=int(w.steps[-1]),
                   slowdown_pct=pct,
                   evidence=evidence,
                   advice="rebalance the data across replicas (length-aware packing or "
                          "bucketing of sequences); no node is at fault")


def _onset(w: Recent, slow: np.ndarray, cfg: WatchConfig) -> int:
    """The first step of the stretch of rows with a clearly slow replica (detect/onset.py). An
    imbalance shows in only some of its rows (``imbalance_frac`` of them at the bar), so the
    level between a healthy window (next to none) and an imbalanced one is half that share."""
    return onset_step(w.steps, slow, level=cfg.imbalance_frac / 2)
