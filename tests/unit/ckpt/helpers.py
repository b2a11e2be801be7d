"""Small plans and synthetic checkpoints for the checkpoint unit tests (no processes)."""

from __future__ import annotations

import torch

from mscale.ckpt.convert import write_layout
from mscale.ckpt.manifest import OPTIM_KEYS, TrainState, optim_key, tensor_key
from mscale.ckpt.ownership import for_plan, write_items
from mscale.config.plan import Plan

MODEL_CFG = dict(name="t", layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=256,
                 seq_len=32)


def plan(tp=1, pp=1, dp=1, zero=1, hier=False, model=None, **training) -> Plan:
    world = tp * pp * dp
    gpn = max(tp, min(world, 2))
    mb = 1
    return Plan.model_validate(dict(
        name="u", cluster=dict(nodes=max(1, world // gpn), gpus_per_node=gpn, gpu="cpu"),
        model={**MODEL_CFG, **(model or {})},
        training={**dict(global_batch=8, micro_batch=mb, precision="fp32", bucket_mb=0.02),
                  **training},
        layout=dict(tp=tp, pp=pp, dp=dp, micro_batch=mb, zero_stage=zero,
                    dp_reduce="hierarchical" if hier else "flat")))


def global_state(p: Plan, seed: int = 0, optimizer: bool = True) -> dict[str, torch.Tensor]:
    """Random global tensors for every model (and optimizer) key of ``p``'s model."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for r in range(p.layout.world_size):
        for it in write_items(for_plan(p, r), optimizer=optimizer):
            if it.key not in out:
                out[it.key] = torch.randn(it.shape, generator=g)
    return out


def source_from(tensors: dict[str, torch.Tensor]):
    def source(it):
        full = tensors[it.key]
        return full[tuple(slice(a, b) for a, b in it.box)].reshape(-1)[it.flat[0]: it.flat[1]]

    return source


def write_synthetic(dst: str, p: Plan, tensors: dict[str, torch.Tensor], step: int = 5,
                    level: int = 1, chunk_bytes: int = 1024):
    optimizer = any(k.startswith("optim.") for k in tensors)
    state = TrainState(step=step, samples=step * 8, optimizer="adamw" if optimizer else None,
                       optimizer_step=step)
    return write_layout(dst, p, source_from(tensors), state, optimizer=optimizer, level=level,
                        chunk_bytes=chunk_bytes)


__all__ = ["plan", "global_state", "write_synthetic", "source_from", "OPTIM_KEYS", "optim_key",
           "tensor_key"]
