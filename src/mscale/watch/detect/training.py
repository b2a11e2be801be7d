"""Loss and gradient-norm rules: NaN/Inf, gradient-norm spikes, loss divergence.

- NaN/Inf: critical. Infinity always; NaN in a scalar only once that scalar has been finite in
  the run (a trainer that never reports a loss leaves the column NaN), and any non-finite
  per-rank timing.
- Gradient-norm spike: the norm above ``grad_spike_factor`` times its exponential moving
  average (spikes do not enter the average), after warm-up. Often the first sign of a bad batch
  or of an instability that a divergence follows.
- Divergence: the median loss over ``divergence_window`` rows rises ``divergence_rel`` above the
  best such median seen. The evidence names the first bad step: the start of the last stretch
  where the loss stayed above an eighth of that rise, so a rollback goes to a checkpoint before
  the trouble began, not merely before it was noticed.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from mscale.watch.config import WatchConfig
from mscale.watch.detect.rows import median
from mscale.watch.findings import Finding

HISTORY = 4096
"""(step, loss) pairs kept to locate a divergence's first bad step (memory stays flat)."""


class TrainingRules:
    def __init__(self, config: WatchConfig):
        self.cfg = config
        self.seen_finite = {"loss": False, "grad_norm": False}
        self.ema: float | None = None
        self.ema_n = 0
        self.losses: deque[float] = deque(maxlen=config.divergence_window)
        self.history: deque[tuple[int, float]] = deque(maxlen=HISTORY)
        self.best: tuple[float, int] | None = None
        """(lowest windowed loss median, its step)."""

    def restarted(self) -> None:
        """A restart resumes from a checkpoint: the loss window starts again (the best level
        and the gradient average carry over; they describe the same run)."""
        self.losses.clear()

    def nan(self, step: int, values: dict[str, float], ranks_finite: bool) -> Finding | None:
        bad = []
        for name, v in values.items():
            if math.isfinite(v):
                self.seen_finite[name] = True
            elif math.isinf(v) or self.seen_finite.get(name):
                bad.append(name)
        if not ranks_finite:
            bad.append("per-rank timings")
        if not bad:
            return None
        return Finding(kind="nan", severity="critical", first_step=step, last_step=step,
                       message=f"non-finite {', '.join(bad)} at step {step}",
                       evidence={"rule": "NaN/Inf in the loss, the gradient norm or a timing",
                                 "fields": bad, "step": step,
                                 **{k: float(v) for k, v in values.items()}},
                       advice="halt the job; resume from the last checkpoint before this step "
                              "(with a lower learning rate or without the batch)")

    def grad_spike(self, step: int, norm: float) -> Finding | None:
        if not math.isfinite(norm):
            return None
        cfg = self.cfg
        if self.ema is not None and self.ema_n >= 5 and norm > cfg.grad_spike_factor * self.ema:
            ratio = norm / self.ema
            return Finding(kind="grad_spike", severity="warning", first_step=step,
                           last_step=step,
                           message=f"gradient norm {norm:.4g} at step {step} is {ratio:.1f}x "
                                   f"its moving average {self.ema:.4g}",
                           evidence={"rule": "gradient norm above k x its moving average",
                                     "grad_norm": norm, "moving_average": self.ema,
                                     "ratio": ratio, "k": cfg.grad_spike_factor, "step": step},
                           advice="watch the loss; a spike followed by a rising loss is a "
                                  "divergence (roll back)")
        alpha = 2.0 / (cfg.grad_ema_steps + 1)
        self.ema = norm if self.ema is None else (1 - alpha) * self.ema + alpha * norm
        self.ema_n += 1
        return None

    def divergence(self, step: int, loss: float) -> Finding | None:
        if not math.isfinite(loss):
            return None
        self.losses.append(loss)
        self.history.append((step, loss))
        if len(self.losses) < self.losses.maxlen:
            return None
        med = float(median(list(self.losses)))
        if self.best is None or med < self.best[0]:
            self.best = (med, step)
        best, best_step = self.best
        rise = self.cfg.divergence_rel * abs(best)
        if med <= best + rise:
            return None
        first = self._first_bad(best + rise / 8, best_step)
        return Finding(kind="divergence", severity="critical", first_step=first, last_step=step,
                       message=f"the loss diverges: median {med:.4g} over the last "
                               f"{len(self.losses)} steps against a best of {best:.4g} "
                               f"(step {best_step}); trouble began at step {first}",
                       evidence={"rule": "windowed loss median above its best level",
                                 "loss_median": med, "best_median": best,
                                 "best_step": best_step, "first_bad_step": first,
                                 "threshold_rel": self.cfg.divergence_rel, "step": step},
                       advice=f"roll back to the last checkpoint before step {first} (and "
                              f"lower the learning rate or skip the data around it)")

    def _first_bad(self, level: float, after: int) -> int:
        """First step of the final stretch whose 3-step running median stays above ``level``."""
        pts = [(s, v) for s, v in self.history if s > after - len(self.losses)]
        steps = np.array([s for s, _ in pts])
        vals = np.array([v for _, v in pts])
        if len(vals) >= 3:
            run = np.median(np.lib.stride_tricks.sliding_window_view(vals, 3), axis=1)
            run = np.concatenate([vals[:1], run, vals[-1:]])  # centred, same length
        else:
            run = vals
        below = np.flatnonzero(run <= level)
        return int(steps[below[-1] + 1]) if len(below) and below[-1] + 1 < len(steps) \
            else int(steps[0])
