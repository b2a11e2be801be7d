"""A tiny MLP with a parameter table, its data, and single-process references.

Shared by the data-parallel unit and distributed tests: a DP run over any layout must end where
`reference_run` (the whole global batch in one process) ends.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mscale.config.training import TrainingConfig
from mscale.parallel.spec import ParamSpec, ParamTable

# name, global shape, tp_dim, weight decay
SHAPES = [("fc1.weight", (24, 12), 0, True), ("fc1.bias", (24,), 0, False),
          ("norm.weight", (24,), None, False), ("fc2.weight", (24, 24), 1, True),
          ("fc2.bias", (24,), None, False), ("head.weight", (6, 24), 1, True)]
IN, OUT = 12, 6
BUCKET_BYTES = 400  # 100 floats: three buckets over the ~1,100 parameters


def make_params(seed: int, tp_rank: int = 0, tp_size: int = 1,
                names: list[str] | None = None) -> list[torch.nn.Parameter]:
    """The model's parameters (this TP rank's slices); the same seed gives the same model."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape, tp_dim, wd in SHAPES:
        full = torch.randn(shape, generator=gen) * 0.3 + (1.0 if name == "norm.weight" else 0.0)
        spec = ParamSpec(name, shape, tp_dim, wd)
        if names is None or name in names:
            out.append(torch.nn.Parameter(full[spec.tp_slice(tp_rank, tp_size)].clone()))
    return out


def make_table(tp_rank: int = 0, tp_size: int = 1, names: list[str] | None = None) -> ParamTable:
    """The table of `make_params`' parameters (same arguments, same order)."""
    return ParamTable(tuple(ParamSpec(name, shape, tp_dim, wd) for name, shape, tp_dim, wd in SHAPES
                            if names is None or name in names), tp_rank, tp_size)


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, IN, generator=gen), torch.randn(n, OUT, generator=gen)


def loss_fn(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, g, w2, b2, w3 = params
    h = F.gelu(F.layer_norm(x @ w1.T + b1, (w1.shape[0],), weight=g))
    h = torch.tanh(h @ w2.T + b2)
    return F.mse_loss(h @ w3.T, y)


def config(optimizer: str = "adamw", **kw) -> TrainingConfig:
    base = dict(global_batch=16, optimizer=optimizer, lr=1e-2, weight_decay=0.1, beta1=0.9,
                beta2=0.95, eps=1e-8, grad_clip=0.5)
    base.update(kw)
    return TrainingConfig(**base)


def lamb_reference_step(params, state, step: int, cfg: TrainingConfig) -> None:
    """Textbook LAMB, per whole tensor, written independently of parallel/optim.py."""
    with torch.no_grad():
        for p, (_, _, _, decay) in zip(params, SHAPES):
            m, v = state.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(cfg.beta1).add_(p.grad, alpha=1 - cfg.beta1)
            v.mul_(cfg.beta2).add_(p.grad * p.grad, alpha=1 - cfg.beta2)
            u = (m / (1 - cfg.beta1 ** step)) / ((v / (1 - cfg.beta2 ** step)).sqrt() + cfg.eps)
            if decay:
                u = u + cfg.weight_decay * p
            wn, un = p.norm().item(), u.norm().item()
            ratio = wn / un if wn > 0 and un > 0 else 1.0
            p.sub_(cfg.lr * ratio * u)


def global_grads(seed: int = 7) -> list[torch.Tensor]:
    """Fixed full-model gradients for tests that inject gradients instead of running a model."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _, shape, _, _ in SHAPES]


class Reference:
    """The single-process optimizer: torch AdamW (no decay where ParamSpec says so) or LAMB."""

    def __init__(self, params, cfg: TrainingConfig, fused: bool = False):
        self.params, self.cfg, self.state, self.steps = params, cfg, {}, 0
        self.opt = None
        if cfg.optimizer == "adamw":  # no decay on norms and biases, as ParamSpec says
            groups = [{"params": [p for p, s in zip(params, SHAPES) if s[3]]},
                      {"params": [p for p, s in zip(params, SHAPES) if not s[3]],
                       "weight_decay": 0.0}]
            self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                         eps=cfg.eps, weight_decay=cfg.weight_decay,
                                         fused=fused)

    def step(self) -> float:
        """Clip, update, clear the gradients; returns the norm before clipping."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.steps += 1
        if self.opt is not None:
            self.opt.step()
        else:
            lamb_reference_step(self.params, self.state, self.steps, self.cfg)
        for p in self.params:
            p.grad = None
        return norm


def reference_run(cfg: TrainingConfig, steps: int, seed: int = 0, fused: bool = False):
    """Whole global batch, one process: torch AdamW or the LAMB above, torch's norm clipping.
    Returns (per-step loss, per-step grad norm, final parameters)."""
    params = make_params(seed)
    ref = Reference(params, cfg, fused=fused)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(params, x, y)
        loss.backward()
        losses.append(loss.item())
        norms.append(ref.step())
    return losses, norms, [p.detach().clone() for p in params]


def dp_run(params, grads, opt, cfg: TrainingConfig, steps: int, dp_rank: int, dp_size: int,
           micro: int = 2):
    """The training loop as the engine runs it, on this DP rank's slice of each global batch."""
    losses, norms, waits = [], [], []
    for step in range(steps):
        x, y = batch(step)
        per = x.shape[0] // dp_size
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        mb, total = per // micro, 0.0
        for j in range(micro):
            ctx = grads.no_sync() if j < micro - 1 else _null()
            with ctx:
                loss = loss_fn(params, x[j * mb:(j + 1) * mb], y[j * mb:(j + 1) * mb]) / micro
                loss.backward()
            total += loss.item()
        waits.append(grads.finish())
        norms.append(opt.grad_norm())
        opt.step(cfg.lr, clip_coef=opt.clip_coef(cfg.grad_clip))
        losses.append(total)
    return losses, norms, waits


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a-b| / (|b| + 1e-3) over all elements of all tensors."""
    return max(float(((x - y).abs() / (y.abs() + 1e-3)).max()) for x, y in zip(a, b))


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)
