"""Every threshold `mscale watch` judges by, each with the reason for its default.

The defaults were set on simulated 3D-parallel traces (`mscale.watch.sim`) with lognormal noise,
GC pauses and checkpoint stalls: no false alarm over long healthy traces at 64 and 1,024 ranks,
every injected cause found within a few steps (`python -m mscale.watch.detect.evaluate`; the
figures are in docs/benchmarks.md). docs/watch.md ("Rules") lists them for operators.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mscale.errors import MscaleError


@dataclass(frozen=True)
class WatchConfig:
    """Thresholds of the detectors. Times in seconds, fractions as 0..1, steps as counts."""

    warmup_steps: int = 5
    """Steps judged by nothing but NaN: the first steps allocate memory, compile and fill caches,
    so they are slower and unevenly so, on every healthy run."""

    persist_steps: int = 8
    """Rows in the per-rank median that decides a straggler: a rank must be slow in more than
    half of them, so a one-step hiccup (a page fault, a late interrupt) is never a straggler, and
    a real one is named 3-5 steps after it starts (docs/benchmarks.md, "watch: detection")."""

    clear_steps: int = 8
    """Consecutive judged rows without the condition before an open finding is closed: a rank
    that hovers at the threshold is one finding, not one per crossing."""

    baseline_steps: int = 16
    """Clean rows after warm-up that set the run's own baseline (step time, throughput, stage
    compute), against which job-wide slowdowns and throughput regressions are measured."""

    z_threshold: float = 5.0
    """Robust z-score (median/MAD across peers) a rank's windowed excess must pass. The largest
    of 12,288 normal draws is about 4 sigma, so 5 keeps a healthy job at that scale silent."""

    min_excess_frac: float = 0.08
    """Smallest excess, as a fraction of the step time, worth naming. Healthy devices differ by
    a few percent and the windowed median of noisy steps moves by one or two: 8% stays clear of
    both on small jobs, where the MAD of a handful of ranks says little and a z-score alone would
    flag a 2% difference nobody should act on."""

    link_min_ratio: float = 1.5
    """A group's communication time, against its peer groups' of the same kind, from which its
    link is slow (detect/links.py). A degraded NIC or cable sends at a fraction of its rate, so
    the group's transfers take several times its peers'; healthy groups differ by tens of
    percent at most, even on oversubscribed CPUs (docs/watch.md, "slow_link")."""

    min_slowdown_pct: float = 2.0
    """What-if slowdown below which a straggler is not reported: a slow rank that is not on the
    critical path (its peers do not wait for it) costs nothing."""

    critical_slowdown_pct: float = 100.0
    """What-if slowdown from which a sick device, node or link, or a job-wide slowdown, is
    ``critical`` rather than a ``warning``: at +100% the job takes twice as long, half of every
    GPU-hour lost to one GPU, host or NIC (or to the fabric or storage every rank shares), as
    much as a job down half of the time. Below it the job still makes most of its progress and
    is a warning, as every other straggler is (imbalances are the plan's or the data's, not a
    fault to act on at once). Graded on the finding's current figure, priced
    on the rows since its onset (detect/straggler.py, detect/links.py) and measured again each
    row, so an open finding whose cost grows past it escalates (and does not go back down while
    open: the run did have it)."""

    node_fraction: float = 0.5
    """Share of a node's ranks that must be slow for the node (not each rank) to be named: a
    node-level fault (power, cooling, PCIe switch) slows all of them, a bad GPU one."""

    step_z: float = 6.0
    """Per-step robust z-score for the sequence/data-imbalance rule, which looks at single steps
    and so needs a higher bar than the windowed rules."""

    imbalance_window: int = 16
    """Rows the data-imbalance rule looks back over."""

    imbalance_frac: float = 0.5
    """Share of those rows that must show one clearly slow DP replica for data imbalance."""

    imbalance_max_share: float = 0.5
    """Largest share of those slow rows one replica may hold: above it the slowness is
    persistent and the rank rules own it; below it the slow replica moves, i.e. the data."""

    stage_min_slowdown_pct: float = 5.0
    """What-if slowdown from which a heavier pipeline stage is reported: some imbalance is
    inherent (embedding, head and loss sit on the end stages), and re-planning for less is
    rarely worth a restart."""

    spike_rel: float = 0.15
    """A row where the median rank's own time (compute + data) is this much above its recent
    median is an every-rank-at-once spike (GC pause, checkpoint snapshot): kept out of the
    per-rank windows, since it says nothing about any one rank."""

    mask_flags: tuple[str, ...] = ("checkpoint", "gc")
    """Keys of a record's ``extra`` that mark a step as a checkpoint or GC step (masked too)."""

    job_wide_rel: float = 0.15
    """Step time above the baseline, beyond what open rank/node/stage findings explain, that
    makes a job-wide slowdown: noise of the windowed median is a few percent."""

    throughput_rel: float = 0.15
    """Fall of tokens/s below the baseline that is a regression when no straggler explains it."""

    job_window: int = 16
    """Rows of the windowed median for the job-level rules (job-wide, throughput): long enough
    that a GC pause or a checkpoint cannot move it."""

    grad_spike_factor: float = 5.0
    """Gradient norm above this multiple of its moving average is a spike: healthy norms wander
    by tens of percent and double now and then; a spike that precedes a divergence is 10x."""

    grad_ema_steps: int = 20
    """Span of the exponential moving average of the gradient norm (spikes do not enter it)."""

    divergence_window: int = 16
    """Rows of the windowed loss median the divergence rule compares."""

    divergence_rel: float = 0.2
    """Rise of the windowed loss median above its best level that is a divergence: a healthy
    run's windowed loss moves by a few percent, a divergent one climbs without end."""

    hang_s: float | None = None
    """Seconds without a new record that make a hang; None derives it from the step time."""

    hang_factor: float = 20.0
    """Without ``hang_s``: hang after this many typical step times (a checkpoint save or an
    evaluation may hold a step several times longer than usual)."""

    hang_min_s: float = 60.0
    """Floor of the derived hang time: CPU steps of 0.1 s must not make a 2 s hang."""

    hang_startup_s: float = 600.0
    """Hang time before any step time is known (loading, compiling and the first step)."""

    expected_step_s: float | None = None
    """Step time the plan predicts, used for the hang time until the run's own is known."""

    micro_batches: int | None = None
    """Micro-batches per step for the what-if replay of the schedule; None takes the plan's,
    or, for metrics without a plan, estimates it from the bubble."""

    max_findings: int = 16
    """Most straggler findings one judgement emits; more slow ranks than this is a job-level
    problem and the job-wide rule reports it."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise MscaleError(f"{f.name} must not be negative (got {v})", field=f.name,
                                  fix=f"give {f.name} a value >= 0")
        for name in ("persist_steps", "baseline_steps", "imbalance_window", "job_window",
                     "divergence_window", "grad_ema_steps", "clear_steps"):
            if getattr(self, name) < 1:
                raise MscaleError(f"{name} must be at least 1", field=name,
                                  fix=f"give {name} a value >= 1")
