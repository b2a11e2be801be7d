"""The distributed optimizer: fp32 master weights and AdamW/LAMB state for the owned shard only.

Under ZeRO 1/2 each DP rank keeps master weights, ``exp_avg`` and ``exp_avg_sq`` for its shard of
every gradient bucket (parallel/buckets.py), updates them from the reduce-scattered gradients, and
all-gathers the updated shards back into the model's parameters. Under ZeRO 0 every rank keeps
and updates everything (identically, from identical all-reduced gradients). Where a rank owns the
whole buffer (ZeRO 0, or DP size 1) and the parameters are fp32, the master weights are the
parameters' flat storage (`ParamGather.buffer`, parallel/param_gather.py) and the step updates
the model in place; under ZeRO 1/2 the all-gather writes straight into that storage.

Per step, after ``grads.finish()``::

    norm = opt.grad_norm()                  # global L2 norm; identical on every rank
    if opt.found_non_finite: ...            # every rank sees the same verdict
    coef = opt.clip_coef(threshold)         # min(1, threshold / (norm + 1e-6))
    comm_wait = opt.step(lr, clip_coef=coef)

Global norms. A parameter sharded over TP (``spec.tp_dim`` set) contributes from every TP rank;
a TP-replicated one holds identical gradients on every TP rank and is counted on TP rank 0 only
(counting it tp times is the classic mistake). Stages hold different parameters, so the sum runs
over the PP group. Under ZeRO 1/2 each DP rank holds a disjoint shard, so it runs over DP too;
under ZeRO 0 every DP rank already has the whole reduced gradient, so it does not. One scalar
all-reduce per group. LAMB's per-parameter norms (of ``w`` and of the update) take the same
path as one vector of 2·(number of parameters) entries: one all-reduce over TP, one over DP.

Checkpoint mapping: `shard_pieces` lists, for each owned piece, the global parameter name and the
range ``[lo, hi)`` of the parameter's *local* flattened tensor (row-major over the shape this rank
holds). With TP that local tensor is ``global[spec.tp_slice(tp_rank, tp_size)]``; `state_dict`
keys the state by that name and range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mscale.distributed.collectives import COMM_CLOCK
from mscale.parallel import optim
from mscale.parallel.buckets import BufferMode
from mscale.parallel.data import GradBuffer
from mscale.parallel.param_gather import ParamGather
from mscale.parallel.spec import ParamSpec, ParamTable

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ShardPiece:
    """One owned piece: ``local_flat[lo:hi]`` of the parameter ``spec.name``."""

    spec: ParamSpec
    lo: int
    hi: int
    local_shape: tuple[int, ...]


class DistributedOptimizer:
    """AdamW or LAMB over the owned shard of a `GradBuffer`."""

    def __init__(self, params: list[torch.nn.Parameter], table: ParamTable, grads: GradBuffer,
                 param_buffer: ParamGather, training, groups=None, fused: bool | None = None):
        """``table``: what each parameter is (TP split, weight decay); ``grads`` and
        ``param_buffer``: the two buffers `data.data_parallel` built over ``params``;
        ``training``: a TrainingConfig (optimizer, beta1, beta2, eps, weight_decay);
        ``fused``: AdamW through torch's fused kernel (`optim.fused_adamw_`); None: on CUDA
        devices, where the optimizer is memory-bound, and not on CPUs, where the single-tensor
        path keeps runs bit-identical to ``torch.optim.AdamW()``'s default."""
        params = list(params)
        same = len(grads.params) == len(params) and all(a is b for a, b in zip(grads.params, params))
        if not same or len(table) != len(params):
            raise ValueError("the optimizer, its table and the gradient buffer must share one "
                             "parameter list")
        self.params, self.table, self.grads = params, table, grads
        self.gather = param_buffer
        """Where updated values go: the parameters' flat storage and its all-gathers."""
        self.kind = training.optimizer
        self.beta1, self.beta2, self.eps = training.beta1, training.beta2, training.eps
        self.weight_decay = training.weight_decay
        self.pieces = grads.pieces
        self.device = grads.device
        alias = param_buffer.buffer if grads.mode is BufferMode.WHOLE else None
        self.master = alias if alias is not None else torch.zeros_like(grads.owned_grad)
        """fp32 master weights over the owned space. Where that is the whole buffer (ZeRO 0, or
        DP size 1) and the parameters are fp32, it is the parameters' flat storage itself
        (`ParamGather.buffer`): the step updates the model in place, nothing is copied."""
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self._piece_param = torch.tensor([pc.param_index for pc in self.pieces], dtype=torch.long,
                                         device=self.device)
        self.step_count = 0
        self.found_non_finite = False
        self._norm: float | None = None
        self._set_groups(groups)
        with torch.no_grad():
            for pc, view in zip(self.pieces, self._views(self.master) if alias is None else []):
                flat = self.params[pc.param_index].detach().reshape(-1)
                view.copy_(flat[pc.param_lo:pc.param_hi])
        decays = [table[pc.param_index].weight_decay for pc in self.pieces]
        self._decay = [i for i, d in enumerate(decays) if d]
        self._plain = [i for i, d in enumerate(decays) if not d]
        self.fused = self.device.type == "cuda" if fused is None else fused
        self._step_t = torch.zeros((), dtype=torch.float32, device=self.device)
        """The step count on the device, for the fused kernel (filled, never read back)."""
        self._grad_scale_t = torch.ones((), dtype=torch.float32, device=self.device)
        """1 / clip factor on the device, the fused kernel's gradient divisor."""

    def _set_groups(self, groups) -> None:
        def live(g, size):
            return g if g is not None and size > 1 else None

        self.tp_group = live(groups.tp_group, groups.tp_size) if groups else None
        self.pp_group = live(groups.pp_group, groups.pp_size) if groups else None
        sharded = self.grads.mode is not BufferMode.WHOLE  # each DP rank holds part of the norm
        self.dp_group = live(groups.dp_group, groups.dp_size) if groups and sharded else None
        tp_rank = dist.get_rank(self.tp_group) if self.tp_group is not None else 0
        counted = [s.tp_dim is not None or tp_rank == 0 for s in self.table]
        self._param_counted = torch.tensor(counted, dtype=torch.float32, device=self.device)
        """Per parameter: 1 if this rank's copy counts in global norms (TP-replicated: rank 0)."""
        self._piece_counted = self._param_counted[self._piece_param]

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[pc.owned_lo: pc.owned_hi] for pc in self.pieces]

    def _sum_over(self, t: torch.Tensor, *kinds: str) -> torch.Tensor:
        """Sum ``t`` over the groups of ``kinds`` (``tp``, ``pp``, ``dp``). Each all-reduce is
        timed as communication of its kind: it waits for every stage and replica to finish its
        backward and reduction, and uncounted that wait read as compute (a slow DP link in
        stage 1 made stage 0 "compute 0.5 s more" and watch advised a re-plan)."""
        for kind in kinds:
            g = {"tp": self.tp_group, "pp": self.pp_group, "dp": self.dp_group}[kind]
            if g is not None:
                with COMM_CLOCK.timed(kind):
                    dist.all_reduce(t, group=g)
        return t

    # ------------------------------------------------------------------------------- norms
    def grad_norm(self) -> float:
        """Global gradient L2 norm before clipping (cached until the step); same on all ranks."""
        if self._norm is None:
            views = self._views(self.grads.owned_grad)
            sq = torch.zeros((), device=self.device)
            if views:
                norms = torch.stack(torch._foreach_norm(views))
                sq = (norms.square() * self._piece_counted).sum()
            total = self._sum_over(sq.reshape(1).double(), "tp", "pp", "dp")
            self._norm = math.sqrt(total.item()) if total.item() >= 0 else math.nan
            self.found_non_finite = not math.isfinite(self._norm)
        return self._norm

    def clip_coef(self, max_norm: float) -> float:
        """Factor that scales the gradient to norm ``max_norm`` at most."""
        return min(1.0, max_norm / (self.grad_norm() + 1e-6))

    def _param_sq_norms(self, views: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(self.params), dtype=torch.float64, device=self.device)
        if views:
            norms = torch.stack(torch._foreach_norm(views)).double().square()
            out.index_add_(0, self._piece_param, norms)
        return out

    def _trust_ratios(self, update: torch.Tensor) -> list[float]:
        w = self._param_sq_norms(self._views(self.master))
        u = self._param_sq_norms(self._views(update))
        both = torch.cat([w, u]) * self._param_counted.double().repeat(2)
        both = self._sum_over(both, "tp", "dp")
        ratio = optim.trust_ratio(both[: len(self.params)], both[len(self.params):])
        return ratio[self._piece_param].tolist()

    # ------------------------------------------------------------------------------- step
    def step(self, lr: float, clip_coef: float = 1.0) -> float:
        """Update the owned shard, write the parameters back; returns seconds blocked on the
        parameter all-gather (0 when the all-gathers are left in flight for the next forward:
        `ParamGather.attach_modules`). Skipped (gradients dropped) when the gradient is not
        finite. The wait is also counted by COMM_CLOCK (the step timer's ``comm_wait``)."""
        self.gather.wait()  # the master shard is the source of gathers still in flight
        self.grad_norm()
        grad = self.grads.owned_grad
        waited = 0.0
        if not self.found_non_finite:
            self.step_count += 1
            if self.fused and self.kind == "adamw":
                self._fused_adamw(grad, lr, clip_coef)  # the kernel scales the gradient
            else:
                if clip_coef != 1.0:
                    grad.mul_(clip_coef)
                (self._adamw if self.kind == "adamw" else self._lamb)(grad, lr)
            waited = self.gather.write(self.master)
        self.grads.zero_grad()
        self._norm = None
        return waited

    def _decay_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views = self._views(flat)
        return [views[i] for i in self._decay]

    def _adamw(self, grad: torch.Tensor, lr: float) -> None:
        if self.weight_decay and self._decay:
            torch._foreach_mul_(self._decay_views(self.master), 1 - lr * self.weight_decay)
        optim.adam_update_(self.master, grad, self.exp_avg, self.exp_avg_sq, step=self.step_count,
                           lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps)

    def _fused_adamw(self, grad: torch.Tensor, lr: float, clip_coef: float) -> None:
        """Two fused launches: the pieces with weight decay, and those without. The clip
        factor rides in as the kernel's gradient divisor, saving a pass over the gradient."""
        self._step_t.fill_(self.step_count)  # kernels with a host scalar: no sync
        scale = None
        if clip_coef != 1.0:
            scale = self._grad_scale_t.fill_(1.0 / clip_coef)
        views = [self._views(t) for t in (self.master, grad, self.exp_avg, self.exp_avg_sq)]
        for wd, idx in ((self.weight_decay, self._decay), (0.0, self._plain)):
            optim.fused_adamw_(*([v[i] for i in idx] for v in views), self._step_t, lr=lr,
                               beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=wd,
                               grad_scale=scale)

    def _lamb(self, grad: torch.Tensor, lr: float) -> None:
        update = optim.lamb_direction(grad, self.exp_avg, self.exp_avg_sq, step=self.step_count,
                                      beta1=self.beta1, beta2=self.beta2, eps=self.eps)
        if self.weight_decay and self._decay:
            torch._foreach_add_(self._decay_views(update), self._decay_views(self.master),
                                alpha=self.weight_decay)
        ratios = self._trust_ratios(update)
        views = self._views(update)
        if views:
            torch._foreach_mul_(views, [-lr * r for r in ratios])
            torch._foreach_add_(self._views(self.master), views)

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers still in flight (`ParamGather.wait`)."""
        self.gather.wait()

    # ------------------------------------------------------------------------------- state
    def shard_pieces(self) -> list[ShardPiece]:
        """What this rank owns: per piece the parameter's spec and local flat range."""
        return [ShardPiece(self.table[pc.param_index], pc.param_lo, pc.param_hi,
                           tuple(self.params[pc.param_index].shape)) for pc in self.pieces]

    def state_dict(self) -> dict:
        """``{"step", "optimizer", "state": {name: {"range": (lo, hi), master, exp_avg,
        exp_avg_sq}}}``: plain tensors keyed by global name and local flat range."""
        state = {}
        for pc in self.pieces:
            entry = {"range": (pc.param_lo, pc.param_hi)}
            for key in STATE_KEYS:
                entry[key] = getattr(self, key)[pc.owned_lo: pc.owned_hi].clone()
            state[pc.name] = entry
        return {"step": self.step_count, "optimizer": self.kind, "state": state}

    def load_state_dict(self, sd: dict) -> None:
        """Load state saved at the same layout (resharding is the checkpoint module's job: it
        can cut a saved global tensor to `shard_pieces`), then write the masters into the model."""
        for pc in self.pieces:
            entry = sd["state"].get(pc.name)
            if entry is None or tuple(entry["range"]) != (pc.param_lo, pc.param_hi):
                raise ValueError(f"optimizer state for {pc.name}[{pc.param_lo}:{pc.param_hi}] "
                                 "is missing or sharded differently; reshard it first")
            self.gather.wait()
            for key in STATE_KEYS:
                getattr(self, key)[pc.owned_lo: pc.owned_hi].copy_(entry[key])
        self.step_count = int(sd["step"])
        self.gather.write(self.master)
        self.grads.zero_grad()
