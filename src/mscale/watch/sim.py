"""Synthetic metrics of a 3D-parallel job, with each straggler cause and training fault injectable.

The proof of the watch rules needs traces whose truth is known. `simulate` produces
metrics.jsonl v1 records of a synchronous tp x pp x dp job whose per-rank split obeys the same
semantics as `train`'s timers (train/timers.py, parallel/pipeline/runner.py):

- a rank is busy for its compute plus, on TP rank 0 (the reader), its data time;
- a TP group runs at its slowest member; the others wait for it inside TP collectives (wait);
- a replica's pipeline is simulated action by action: every forward and backward of every
  micro-batch (and chunk) through the engine's schedule (parallel/pipeline/schedule.py), each
  with its own jitter, so micro-batches differ as they do on a machine; a stage's time beyond
  its own is bubble. This is the ground truth the what-if (watch/replay.py, which sees only the
  per-step sums a record carries) is measured against;
- replicas meet in the gradient reduction: the step is the slowest replica plus the exposed
  reduction, and every faster replica waits (wait);
so each rank's compute + data + wait + bubble is the step time, as in a real record.

Noise is realistic rather than Gaussian: per-rank lognormal jitter (3%), a per-rank constant
(devices differ by ~1%), a job-wide per-step factor, rare one-step hiccups on single ranks, GC
pauses on every rank at the same steps and checkpoint stalls, optionally without the ``extra``
flags that mark them (``flag_pauses=False``), warm-up steps, a decreasing noisy loss and a
wandering gradient norm. Causes are injected from a step on (`Injection`); the data-imbalance
injection moves the slow replica every step.

Communication is also split by kind, as train records it (``comm_tp``, ``comm_dp``,
``comm_pp``): a TP group's transfer (its collectives' time when no member is late) plus each
member's wait for its slowest peer; a DP group's reduction plus the replica's wait for the
slowest replica; the bubble as pipeline wait. A slow link on a rank makes the transfers of its TP
and DP groups slower for every member of those groups, the culprit included; ``host_work``
(not a straggler cause) makes a rank do work its timers do not trace (rank 0 writing logs), so
its peers wait on it while its own parts add up to less than the step. Everything is drawn with
numpy from ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from mscale.errors import MscaleError
from mscale.watch.layout import JobLayout
from mscale.watch.replay import replay_actions, schedulable, step_graph
from mscale.watch.window import PER_RANK, SCALARS, Window

CAUSES = ("slow_device", "slow_node", "slow_link", "slow_data", "stage_imbalance",
          "data_imbalance", "job_wide", "grad_spike", "nan", "divergence", "host_work")

DEFAULT_MAGNITUDE = {
    "slow_device": 0.3,       # compute x1.3
    "slow_node": 0.25,        # compute x1.25 on every rank of the node
    "slow_link": 0.2,         # seconds per step (x base compute) added to its groups' transfers
    "slow_data": 0.3,         # seconds of data time per step (x base compute)
    "stage_imbalance": 0.4,   # compute x1.4 on one stage
    "data_imbalance": 0.4,    # compute x(1 + 0.4 * U(0.5, 1.5)) on one replica, a new one each step
    "job_wide": 0.5,          # seconds of reduction wait per step (x base compute): the network
    "grad_spike": 20.0,       # gradient norm x20 for one step
    "nan": 1.0,
    "divergence": 0.03,       # loss x exp(0.03 * steps since the onset)
    "host_work": 0.2,         # untraced seconds per step (x base compute) on one rank
}


@dataclass(frozen=True)
class Injection:
    """One fault: ``cause`` from ``step`` on (1-based), on ``target`` (a rank for device, link and
    data; a node index for node; a stage for stage imbalance; unused otherwise)."""

    cause: str
    step: int
    target: int | None = None
    magnitude: float | None = None
    until: int | None = None
    """Last affected step (inclusive); None: to the end."""

    @property
    def size(self) -> float:
        return DEFAULT_MAGNITUDE[self.cause] if self.magnitude is None else self.magnitude


@dataclass
class Trace:
    """A simulated run as arrays (``[steps, world]`` per part)."""

    layout: JobLayout
    steps: np.ndarray
    step_time: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    data: np.ndarray
    bubble: np.ndarray
    scalars: dict[str, np.ndarray]
    extra: list[dict] = field(default_factory=list)
    comm_tp: np.ndarray | None = None
    comm_pp: np.ndarray | None = None
    comm_dp: np.ndarray | None = None

    def window(self) -> Window:
        ranks = np.stack([getattr(self, n) for n in ("step_time", "compute", "comm", "data",
                                                       "bubble", "comm_tp", "comm_pp",
                                                       "comm_dp")], axis=1)
        assert len(PER_RANK) == ranks.shape[1]
        scal = np.stack([self.scalars.get(n, np.full(len(self.steps), np.nan))
                         for n in SCALARS], axis=1)
        return Window(self.steps.copy(), ranks, scal, [dict(e) for e in self.extra])

    def records(self) -> list[dict]:
        """metrics.jsonl schema v1 records (config/records.py: MetricsRecord)."""
        s = self.scalars
        out = []
        for i, step in enumerate(self.steps.tolist()):
            out.append({
                "schema_version": 1, "step": step, "time": float(s["time"][i]),
                "loss": float(s["loss"][i]), "grad_norm": float(s["grad_norm"][i]),
                "clip_threshold": float(s["clip_threshold"][i]), "lr": float(s["lr"][i]),
                "tokens": int(s["tokens"][i]), "tokens_per_s": float(s["tokens_per_s"][i]),
                "mfu": float(s["mfu"][i]),
                "step_time": self.step_time[i].tolist(), "compute_time": self.compute[i].tolist(),
                "comm_wait": self.comm[i].tolist(), "data_time": self.data[i].tolist(),
                "bubble_time": self.bubble[i].tolist(), "comm_tp": self.comm_tp[i].tolist(),
                "comm_pp": self.comm_pp[i].tolist(), "comm_dp": self.comm_dp[i].tolist(),
                "extra": dict(self.extra[i])})
        return out


def simulate(world: int, tp: int = 1, pp: int = 1, dp: int | None = None,
             ranks_per_node: int = 8, steps: int = 200, seed: int = 0,
             inject=(), **knobs) -> list[dict]:
    """metrics.jsonl v1 records of a simulated job (module docstring); ``inject``: `Injection`s
    or dicts of their fields. ``knobs``: see `generate`."""
    return generate(world, tp, pp, dp, ranks_per_node, steps, seed, inject, **knobs).records()


def generate(world: int, tp: int = 1, pp: int = 1, dp: int | None = None,
             ranks_per_node: int = 8, steps: int = 200, seed: int = 0, inject=(), *,
             base_compute: float = 1.0, micro_batches: int = 8, vpp: int = 1,
             micro_noise: float = 0.05, noise: float = 0.03,
             gc_every: int = 50, gc_pause: float = 0.25, ckpt_every: int = 200,
             ckpt_stall: float = 1.0, flag_pauses: bool = True, hiccup_rate: float = 2e-4,
             warmup: tuple[float, ...] = (3.0, 1.5, 1.2), stage_weights=None) -> Trace:
    """The arrays behind `simulate`. Times are in units of ``base_compute`` seconds.
    ``micro_batches`` is raised to the nearest count the engine accepts (at least pp);
    ``micro_noise``: the lognormal jitter of each action around its stage's share."""
    dp = world // (tp * pp) if dp is None else dp
    if tp * pp * dp != world or min(tp, pp, dp, steps) < 1:
        raise MscaleError(f"tp {tp} x pp {pp} x dp {dp} is not world {world}",
                          field="world", fix="give tp * pp * dp == world")
    layout = replace(JobLayout.from_flags(tp, pp, dp, min(ranks_per_node, world), vpp=vpp),
                     micro_batches=schedulable(pp, vpp, micro_batches),
                     named=True)  # node0, node1...: the simulated cluster's own names
    injections = [i if isinstance(i, Injection) else Injection(**i) for i in inject]
    for inj in injections:
        if inj.cause not in CAUSES:
            raise MscaleError(f"unknown cause {inj.cause!r}", field="inject",
                              fix=f"use one of {', '.join(CAUSES)}")
    rng = np.random.default_rng(seed)
    n, c0 = steps, base_compute
    stage = layout.pp_rank
    weights = np.ones(pp) if stage_weights is None else np.asarray(stage_weights, float)
    compute = c0 * weights[stage] * rng.lognormal(0, 0.01, world)  # devices differ a little
    compute = compute * rng.lognormal(0, 0.01, (n, 1)) * rng.lognormal(0, noise, (n, world))
    hiccup = rng.random((n, world)) < hiccup_rate
    compute += hiccup * rng.uniform(0.05, 0.3, (n, world)) * c0
    reader = layout.tp_rank == 0
    data = np.where(reader, 0.03 * c0 * rng.lognormal(0, 0.2, (n, world)),
                    0.001 * c0 * rng.lognormal(0, 0.2, (n, world)))
    tpc = (0.04 * c0 * rng.lognormal(0, 0.1, (n, pp, dp))) if tp > 1 else np.zeros((n, pp, dp))
    reduce = 0.06 * c0 * rng.lognormal(0, 0.1, n)
    link = np.zeros((n, pp, tp))  # extra reduction time of each DP group (a slow link in it)
    hidden = np.zeros((n, world))  # untraced host work
    steps_arr = np.arange(1, n + 1)
    w = np.ones(n)
    w[: len(warmup)] = warmup[:n]
    compute *= w[:, None]
    extra = [{} for _ in range(n)]
    for i in range(n):
        s = i + 1
        if gc_every and s % gc_every == 0:
            compute[i] += gc_pause * c0 * rng.lognormal(0, 0.1, world)
            if flag_pauses:
                extra[i]["gc"] = True
        if ckpt_every and s % ckpt_every == 0:
            compute[i] += ckpt_stall * c0 * rng.lognormal(0, 0.05, world)
            if flag_pauses:
                extra[i]["checkpoint"] = True
    scal = _scalars(rng, n)
    for inj in injections:
        rows = (steps_arr >= inj.step) & (steps_arr <= (inj.until or n))
        _apply(inj, rows, layout, rng, c0, compute, data, reduce, (tpc, link, hidden), scal)
    graph = step_graph(pp, vpp, layout.micro_batches) if pp > 1 else None
    # the actions' jitter has a stream of its own, so a healthy and an injected trace of one
    # seed jitter alike whatever the injections drew
    pipe = (graph, np.random.default_rng([seed, 1]), micro_noise)
    return _assemble(layout, steps_arr, compute, data, tpc, reduce, link, hidden, pipe,
                     scal, extra, rng)


def _apply(inj: Injection, rows, layout: JobLayout, rng, c0, compute, data, reduce, comm,
           scal) -> None:
    """Change the arrays in place for one injection over the boolean step mask ``rows``."""
    k, t = inj.size, inj.target
    tpc, link, hidden = comm
    if inj.cause == "slow_device":
        compute[rows, t] *= 1 + k
    elif inj.cause == "slow_node":
        compute[np.ix_(rows, layout.node == t)] *= 1 + k
    elif inj.cause == "stage_imbalance":
        compute[np.ix_(rows, layout.pp_rank == t)] *= 1 + k
    elif inj.cause == "slow_data":
        data[rows, t] += k * c0
    elif inj.cause == "slow_link":
        # the transfers of its TP group and of its DP group take longer, for every member
        s, d, p = layout.pp_rank[t], layout.dp_rank[t], layout.tp_rank[t]
        share = k * c0 / ((layout.tp > 1) + (layout.dp > 1) or 1)
        if layout.tp > 1:
            tpc[rows, s, d] += share
        if layout.dp > 1 or layout.tp == 1:
            link[rows, s, p] += share
    elif inj.cause == "host_work":
        hidden[rows, t] += k * c0
    elif inj.cause == "data_imbalance":
        idx = np.flatnonzero(rows)
        slow = rng.integers(0, layout.dp, len(idx))
        factor = 1 + k * rng.uniform(0.5, 1.5, len(idx))
        hit = layout.dp_rank[None, :] == slow[:, None]
        compute[idx] *= np.where(hit, factor[:, None], 1.0)
    elif inj.cause == "job_wide":
        reduce[rows] += k * c0
    elif inj.cause == "grad_spike":
        one = np.flatnonzero(rows)[:1] if inj.until is None else np.flatnonzero(rows)
        scal["grad_norm"][one] *= k
    elif inj.cause == "nan":
        scal["loss"][rows] = np.nan
        scal["grad_norm"][rows] = np.nan
    elif inj.cause == "divergence":
        idx = np.flatnonzero(rows)
        since = np.arange(len(idx))
        scal["loss"][idx] *= np.exp(k * since)
        scal["grad_norm"][idx] *= 1 + 0.05 * since


def _scalars(rng, n: int) -> dict[str, np.ndarray]:
    t = np.arange(1, n + 1)
    loss = (2.0 + 6.0 * np.exp(-t / 400)) * rng.lognormal(0, 0.02, n)
    grad = (0.5 + 2.0 * np.exp(-t / 200)) * rng.lognormal(0, 0.15, n)
    lr = 3e-4 * np.minimum(1.0, t / 50) * (0.55 + 0.45 * np.cos(np.pi * np.minimum(t / 1e5, 1)))
    return {"loss": loss, "grad_norm": grad, "lr": lr, "clip_threshold": np.ones(n)}


def _pipeline(group: np.ndarray, pipe) -> np.ndarray:
    """``[n, pp, dp]`` busy seconds of each TP group → ``[n, dp]`` each replica's pipeline time,
    simulated action by action with jitter (module docstring). Each group's actions still sum
    to its busy time: the record's numbers stay the truth, only their spread over the
    micro-batches is unknown to the reader."""
    graph, rng, sigma = pipe
    if graph is None:
        return group[:, 0]
    n, pp, dp = group.shape
    jitter = rng.lognormal(0, sigma, (graph.actions, n, dp))
    weight = graph.weight[:, None, None]
    per_stage = np.zeros((pp, n, dp))
    np.add.at(per_stage, graph.stage, weight * jitter)   # each stage's weights sum to 1
    durations = np.moveaxis(group, 1, 0)[graph.stage] * weight * jitter / per_stage[graph.stage]
    return replay_actions(graph, durations)


def _assemble(layout: JobLayout, steps, compute, data, tpc, reduce, link, hidden, pipe, scal,
              extra, rng) -> Trace:
    """Per-rank wait, bubble and step time from the busy times (module docstring)."""
    n, world = compute.shape
    g = (n, layout.pp, layout.dp, layout.tp)
    own = (compute + data).reshape(g)
    late = own + hidden.reshape(g)  # when each rank reaches its TP collectives
    group = late.max(axis=3) + tpc                                  # [n, pp, dp]
    replica = _pipeline(group, pipe)                                # [n, dp]
    slowest = replica.max(axis=1)                                   # [n]
    red = reduce[:, None, None] + link                              # [n, pp, tp] per DP group
    step = slowest + red.max(axis=(1, 2))
    tp_comm = (group - tpc)[..., None] - late + tpc[..., None]
    bubble = np.broadcast_to(replica[:, None, :, None] - group[..., None], g)
    dp_comm = (slowest[:, None] - replica)[:, None, :, None] + red[:, :, None, :]
    # a DP group done early waits for the slowest one at the next step's first transfer
    pp_comm = bubble + (red.max(axis=(1, 2))[:, None, None] - red)[:, :, None, :]
    comm = (tp_comm + dp_comm + pp_comm - bubble).reshape(n, world)
    step_time = np.repeat(step[:, None], world, axis=1) + rng.normal(0, 1e-4, (n, world))
    tokens = np.full(n, 1 << 20)
    scal = dict(scal, tokens=tokens, tokens_per_s=tokens / step,
                time=1.7e9 + np.cumsum(step), mfu=0.45 * np.median(step) / step)
    return Trace(layout, steps, step_time, compute, comm, data, bubble.reshape(n, world), scal,
                 extra, comm_tp=tp_comm.reshape(n, world), comm_pp=pp_comm.reshape(n, world),
                 comm_dp=dp_comm.reshape(n, world))


def _injection(text: str) -> Injection:
    """``CAUSE:STEP[:TARGET[:MAGNITUDE]]`` (``slow_device:10:3``) → an `Injection`."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 4 or parts[0] not in CAUSES:
        raise MscaleError(f"--inject {text!r}: not CAUSE:STEP[:TARGET[:MAGNITUDE]]",
                          field="inject", fix=f"CAUSE is one of {', '.join(CAUSES)}; "
                          "e.g. --inject slow_device:10:3 (rank 3 from step 10)")
    try:
        step = int(parts[1])
        target = int(parts[2]) if len(parts) > 2 and parts[2] else None
        magnitude = float(parts[3]) if len(parts) > 3 else None
    except ValueError:
        raise MscaleError(f"--inject {text!r}: STEP and TARGET are integers, MAGNITUDE a number",
                          field="inject", fix="e.g. --inject slow_device:10:3:0.5") from None
    return Injection(parts[0], step, target, magnitude)


def main(argv: list[str] | None = None) -> int:
    """``python -m mscale.watch.sim``: a simulated job's metrics.jsonl on stdout, one line on
    stderr saying what it wrote (another trainer's metrics to try ``mscale watch`` on)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m mscale.watch.sim",
        description="Write the metrics.jsonl records (schema v1) of a simulated synchronous "
                    "tp x pp x dp job on stdout, with faults injected: e.g. "
                    "--world 1024 --tp 8 --pp 4 --steps 30 --inject slow_device:10:3 > trace.jsonl")
    ap.add_argument("--world", type=int, required=True, help="ranks in the job")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    ap.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument("--steps", type=int, default=200, help="steps to simulate (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--inject", action="append", default=[],
                    metavar="CAUSE:STEP[:TARGET[:MAGNITUDE]]",
                    help=f"a fault from STEP on (repeatable); CAUSE: {', '.join(CAUSES)}; TARGET "
                         "a rank (device, link, data, host_work), a node index (node) or a "
                         "stage (stage_imbalance)")
    a = ap.parse_args(argv)
    try:
        inject = [_injection(t) for t in a.inject]
        records = simulate(a.world, tp=a.tp, pp=a.pp, ranks_per_node=a.ranks_per_node,
                           steps=a.steps, seed=a.seed, inject=inject)
    except MscaleError as e:
        sys.stderr.write(f"error: {e}\n")
        return 3
    sys.stdout.writelines(json.dumps(r) + "\n" for r in records)
    sys.stdout.flush()
    faults = "; ".join(f"{i.cause} from step {i.step}"
                       + (f" on target {i.target}" if i.target is not None else "") for i in inject)
    sys.stderr.write(f"wrote {len(records)} steps of a simulated {a.world:,}-rank job "
                     f"(tp{a.tp} pp{a.pp} dp{a.world // (a.tp * a.pp)}, {a.ranks_per_node} a "
                     f"node) to stdout; {faults or 'no fault injected'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
