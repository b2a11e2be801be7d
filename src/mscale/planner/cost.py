"""The cost model: one layout (or a whole array of them) → memory, step time, MFU, and every term.

`evaluate_arrays` is the single implementation; `evaluate` wraps one LayoutConfig into arrays of
length one, so the search and the evaluation of a given layout cannot disagree.

Step time on the critical path (the slowest pipeline rank)::

    step = m·t_stage + bubble + exposed TP + exposed PP + exposed DP
    t_stage   = kernel time of the slowest rank per micro-batch (kernels.py: GEMMs by shape,
                attention by head dim and sequence, memory-bound work by bandwidth)
    bubble    = (p−1)/(v·m) · m·t_stage                      (docs/references.md, Narayanan et al. §2.2)

and m·t_stage is shown split into model work, recompute and stage imbalance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property, lru_cache

import numpy as np

from mscale.config.cluster import ClusterConfig
from mscale.config.layout import LayoutConfig, centre_window, even_split
from mscale.config.model import ModelConfig
from mscale.config.training import TrainingConfig
from mscale.planner import flops
from mscale.planner.kernels import Device, block_times, head_time
from mscale.planner.stacks import StackProfile, stack_profile
from mscale.planner.comm import Links, dp_exposed, dp_half, pp_exposed, tp_exposed
from mscale.planner.constants import ACT_BYTES, GRAD_REDUCE_BYTES, MEMORY_USABLE_FRACTION
from mscale.planner.memory import RECOMPUTE_CODES, rank_memory


@dataclass(frozen=True)
class Problem:
    """What is being planned: model, training settings, cluster, and quantities derived once."""

    model: ModelConfig
    training: TrainingConfig
    cluster: ClusterConfig
    stack: str | None = None
    """Stack profile name overriding ``training.stack`` (``mscale plan --stack``)."""
    calibration: object | None = None
    """A `calibrate.Calibration`: measured rates replacing datasheet ones (``--calibrate``)."""

    @cached_property
    def stack_profile(self) -> StackProfile:
        return stack_profile(self.stack or getattr(self.training, "stack", None),
                             compiled=self.compiled)

    @cached_property
    def compiled(self) -> bool:
        """Whether the engine compiles its blocks: ``training.compile``, or by default on GPUs
        and not on CPUs (the engine's rule: parallel/compile.py wants_compile)."""
        switch = getattr(self.training, "compile", None)
        return self.cluster.gpu.name.lower() != "cpu" if switch is None else switch

    @cached_property
    def device(self) -> Device:
        dev = Device.of(self.cluster.gpu)
        return self.calibration.device(dev) if self.calibration is not None else dev

    @cached_property
    def links(self) -> Links:
        links = Links.of(self.cluster)
        return self.calibration.links(links) if self.calibration is not None else links

    @cached_property
    def peak(self) -> float:
        """Dense FLOP/s of one GPU (docs/references.md; never the sparse figure)."""
        return self.cluster.gpu.peak_tflops * 1e12

    @cached_property
    def budget_bytes(self) -> float:
        return self.cluster.gpu.memory_gb * 1e9 * MEMORY_USABLE_FRACTION

    @cached_property
    def model_flops(self) -> float:
        return flops.model_flops(self.model, self.training.global_batch)


@dataclass
class LayoutCost:
    """Every term of one layout's cost. Times in seconds per step, memory in bytes per GPU."""

    mem_weights: float
    mem_gradients: float
    mem_optimizer: float
    mem_activations: float
    mem_logits: float
    mem_weight_copies: float
    """Low-precision weight copies kept for the step's backward (inside ``mem_activations``)."""
    mem_total: float
    mem_budget: float
    fits: bool
    micro_batches: int
    t_model: float
    t_recompute: float
    t_imbalance: float
    t_bubble: float
    t_tp: float
    t_pp: float
    t_dp: float
    step_time: float
    tokens_per_s: float
    mfu: float
    hfu: float
    host_pinned: float = 0.0
    """Host (not GPU) bytes per rank: the checkpoint's pinned host arena."""

    def losses(self) -> dict[str, float]:
        """Where the peak goes, as shares of the step's device time; with MFU they sum to 1.

        ``t_model`` is the model's work at the kernels' real rates, balanced over the pipeline:
        its excess over the ideal time (model FLOPs at peak, i.e. MFU × step) is "kernels";
        recomputation, imbalance, bubble and exposed communication follow.
        """
        t = self.step_time
        out = {"kernels": max(self.t_model / t - self.mfu, 0.0),
               "recompute": self.t_recompute / t}
        for name in ("imbalance", "bubble", "tp", "pp", "dp"):
            out[name] = getattr(self, f"t_{name}") / t
        return out

    def as_dict(self) -> dict:
        d = asdict(self)
        d["losses"] = self.losses()
        return d


COST_FIELDS = [f.name for f in fields(LayoutCost)]


def evaluate_arrays(pb: Problem, c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Cost of every candidate in ``c`` (arrays: tp, pp, vpp, dp, mb, sp, rec, zero, hier,
    and `LAYER_COUNT_KEYS`: blocks per pipeline rank)."""
    m_, tr = pb.model, pb.training
    tp, pp, vpp, dp, mb = c["tp"], c["pp"], c["vpp"], c["dp"], c["mb"]
    rec, zero = c["rec"], c["zero"]
    micro = tr.global_batch // (dp * mb)
    stack = pb.stack_profile

    # kernel time per micro-batch on the slowest rank (forward + backward, + recompute)
    bt = block_times(m_, pb.device, stack, tp, mb, c["sp"], rec)
    layer_t = bt.work + bt.recompute
    head_t = head_time(m_, pb.device, tp, mb)
    t_stage = np.maximum(c["max_layers"] * layer_t, c["last_layers"] * layer_t + head_t)
    t_compute = micro * t_stage
    world = pb.cluster.world_size
    t_model = micro * (m_.layers * bt.work + head_t) / pp  # balanced over the pipeline ranks
    t_recompute = micro * m_.layers * bt.recompute / pp
    t_bubble = np.where(pp > 1, (pp - 1) / (vpp * micro) * t_compute, 0.0)
    extra = np.select([rec == 2, rec == 1], [flops.layer_forward_flops(m_),
                                             flops.attention_core_forward_flops(m_)], 0.0)

    # communication
    act = m_.seq_len * mb * m_.hidden * ACT_BYTES
    per_layer_coll = 2 if m_.parallel_block else 4
    passes = np.where(rec == 2, 3, 2)  # forward, backward, and the recomputed forward
    t_tp = np.where(tp > 1, tp_exposed(act, tp, pb.links, micro * c["max_layers"] * per_layer_coll
                                       * passes, stack.tp_overlap), 0.0)
    # forward of one micro-batch on the slowest rank, all its chunks
    t_fwd = np.minimum(c["max_layers"] * bt.forward + head_t / 3, t_stage / 2)
    t_pp = pp_exposed(act, tp, pp, vpp, micro, tp * dp, pb.links, t_fwd / vpp, stack.pp_overlap)
    mem = rank_memory(pb, c, micro)  # planner/memory.py: what the engine allocates
    grad_bytes = mem["rank_params"] * GRAD_REDUCE_BYTES[tr.precision]
    half = dp_half(grad_bytes, dp, tp, pb.links, c["hier"])
    overlap = tr.overlap_grad_reduce and stack.dp_overlap
    t_dp = np.where(dp > 1, dp_exposed(half, zero, overlap, t_fwd, t_stage - t_fwd), 0.0)

    step = t_compute + t_bubble + t_tp + t_pp + t_dp
    out = {k: v for k, v in mem.items() if k != "rank_params"}
    out.update(micro_batches=micro, t_model=t_model,
               t_recompute=t_recompute, t_imbalance=np.maximum(t_compute - t_model - t_recompute, 0),
               t_bubble=t_bubble, t_tp=t_tp, t_pp=t_pp, t_dp=t_dp, step_time=step,
               tokens_per_s=tr.global_batch * m_.seq_len / step,
               mfu=pb.model_flops / (step * world * pb.peak),
               hfu=(pb.model_flops + tr.global_batch * m_.layers * extra) / (step * world * pb.peak))
    return out


LayerCounts = tuple[int, int, int, int, int, int]
"""Blocks per pipeline rank, as the cost model needs them (`counts_of`): the most of any rank,
the first rank's, the last's, rank 1's, the most of a middle rank, and the middle rank holding
that many first (memory.py prices the middle ranks from the last three)."""
LAYER_COUNT_KEYS = ("max_layers", "first_layers", "last_layers", "second_layers", "mid_layers",
                    "mid_at")
"""The candidate arrays' names for a `LayerCounts`."""


def counts_of(per_rank: list[int]) -> LayerCounts:
    """`LayerCounts` of blocks per pipeline rank. A middle rank's memory grows with its blocks
    and with its micro-batches in flight, which fall from rank 1 on; so when the middle ranks
    hold two block counts (every split the search makes), the fullest middle rank is rank 1 or
    the first holding the most. With more counts (a hand-written ``stage_layers``) the returned
    rank is 1: the most blocks at the most in flight, a bound above every middle rank."""
    most, first, last = max(per_rank), per_rank[0], per_rank[-1]
    middle = per_rank[1:-1]
    if not middle:
        return most, first, last, 0, 0, 1
    top = max(middle)
    at = 1 + middle.index(top) if len(set(middle)) <= 2 else 1
    return most, first, last, middle[0], top, at


def rank_layers(layout: LayoutConfig, layers: int) -> LayerCounts:
    """`LayerCounts` of a layout; rank r runs chunks r, r+p, …"""
    if layout.stage_layers is None:
        return rank_layer_counts(layers, layout.pp, layout.vpp)
    split = layout.layers_per_stage(layers)
    return counts_of([sum(split[r::layout.pp]) for r in range(layout.pp)])


@lru_cache(maxsize=4096)
def rank_layer_counts(layers: int, pp: int, vpp: int) -> LayerCounts:
    """`LayerCounts` under the default even split.

    In closed form for the splits the search produces (an exact split, or vpp = 1), so its cost
    does not grow with the number of stages; `even_split` spells out the rule used here: the
    remainder goes to the middle stages nearest the centre first (lower index on a tie), then
    to the first stage. tests/unit/planner/test_bounds.py checks it against the split.
    """
    stages = pp * vpp
    if layers % stages == 0:
        n, mid = layers // pp, (layers // pp if pp > 2 else 0)
        return n, n, n, mid, mid, 1
    if vpp == 1:
        base, extra = divmod(layers, pp)
        if pp <= 2:
            return base + 1, base + 1, base + (extra > 1), 0, 0, 1
        lo, take = centre_window(extra, pp)
        return (base + 1, base + (extra > pp - 2), base, base + (lo <= 1 < lo + take),
                base + 1, lo)
    split = even_split(layers, stages)
    return counts_of([sum(split[r::pp]) for r in range(pp)])


def layout_arrays(layouts: list[LayoutConfig], layers: int) -> dict[str, np.ndarray]:
    """Candidate arrays (see `evaluate_arrays`) for a list of layouts."""
    rows = []
    for lo in layouts:
        rows.append((lo.tp, lo.pp, lo.vpp, lo.dp, lo.micro_batch, lo.sequence_parallel,
                     RECOMPUTE_CODES[lo.recompute], lo.zero_stage, lo.dp_reduce == "hierarchical",
                     *rank_layers(lo, layers)))
    keys = ("tp", "pp", "vpp", "dp", "mb", "sp", "rec", "zero", "hier", *LAYER_COUNT_KEYS)
    return {k: np.array([r[i] for r in rows]) for i, k in enumerate(keys)}


def evaluate(pb: Problem, layout: LayoutConfig) -> LayoutCost:
    """The cost of one layout (which must already pass check_layout)."""
    out = evaluate_arrays(pb, layout_arrays([layout], pb.model.layers))
    return cost_at(out, 0)


def cost_at(out: dict[str, np.ndarray], i: int) -> LayoutCost:
    """The LayoutCost of candidate ``i`` of an `evaluate_arrays` result."""
    vals = {}
    for k in COST_FIELDS:
        v = np.asarray(out[k])
        v = v[i] if v.ndim else v
        vals[k] = bool(v) if k == "fits" else int(v) if k == "micro_batches" else float(v)
    return LayoutCost(**vals)
