"""Forward+backward time of mscale's tensor parallelism against one process and against DTensor.

    .venv/bin/python bench/bench_tp.py [--steps 20]

Prints milliseconds per forward+backward (the fastest of ``--steps`` after warm-up: on a shared
2-core machine the minimum is the figure least disturbed by other load) for: one process
(one thread, like each rank), mscale TP=2 (± SP) on gloo, and DTensor TP=2 (ColwiseParallel /
RowwiseParallel on the same block shapes; embedding and head replicated, which favours DTensor).
The ratio column is against the one-process time measured in the same run. A measurement, not a
test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mscale.distributed.spawn import run_distributed  # noqa: E402

MODELS = {
    "tiny": (dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                  seq_len=64), 2),
    "small": (dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=768, vocab=4096,
                   seq_len=256), 4),
}


def _time(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def _batch(cfg, b):
    tokens = torch.randint(0, cfg.vocab, (b, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _mscale_step(model, x, labels):
    def step():
        model(x, labels).backward()
        model.zero_grad(set_to_none=True)
    return step


def _mscale(rank, world, name, sp, steps):
    from mscale.config.model import ModelConfig
    from mscale.model import Transformer
    from mscale.parallel.parallelize import init_parameters, parallelize
    from mscale.parallel.tensor import TensorParallel

    torch.set_num_threads(1)
    overrides, b = MODELS[name]
    cfg = ModelConfig(**overrides)
    if world == 1:
        tp = TensorParallel.single()
    else:
        import torch.distributed as dist
        tp = TensorParallel(dist.group.WORLD, world, rank, sequence_parallel=sp)
    with torch.device("meta"):  # as the engine's build_chunks: only this rank's shards allocated
        plain = Transformer(cfg)
    model, table = parallelize(plain, tp)
    model = model.to_empty(device="cpu")
    init_parameters(list(model.parameters()), table, 0, cfg.layers)
    return _time(_mscale_step(model, *_batch(cfg, b)), steps)


class _DTensorBlock(torch.nn.Module):
    """The same block shapes with nn.Linear, to be parallelised by DTensor."""

    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.wq, self.wk, self.wv = lin(h, cfg.heads * d), lin(h, cfg.num_kv_heads * d), \
            lin(h, cfg.num_kv_heads * d)
        self.wo = lin(cfg.heads * d, h)
        self.gate, self.up, self.down = lin(h, cfg.ffn), lin(h, cfg.ffn), lin(cfg.ffn, h)
        self.d = d

    def forward(self, x):  # [b, s, h]; attention on local tensors (SDPA has no DTensor rule)
        import torch.nn.functional as F

        b, s, _ = x.shape
        n = self.attn_norm(x)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2)
                   for t in (self.wq(n), self.wk(n), self.wv(n)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        n = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


def _dtensor(rank, world, name, steps):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from mscale.config.model import ModelConfig

    torch.set_num_threads(1)
    overrides, b = MODELS[name]
    cfg = ModelConfig(**overrides)
    mesh = init_device_mesh("cpu", (world,))
    embed = torch.nn.Embedding(cfg.vocab, cfg.hidden)
    blocks = torch.nn.ModuleList(_DTensorBlock(cfg) for _ in range(cfg.layers))
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
            "down": RowwiseParallel()}
    for block in blocks:
        parallelize_module(block, mesh, plan)
    head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)
    x, labels = _batch(cfg, b)

    def step():
        h = embed(x)
        for block in blocks:
            h = block(h)
        F.cross_entropy(head(h).flatten(0, 1), labels.flatten()).backward()
        for m in (embed, blocks, head):
            m.zero_grad(set_to_none=True)
    return _time(step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    print(f"{'model':6} {'variant':22} {'ms/step':>9} {'ratio':>6}")
    for name in args.models:
        base = _mscale(0, 1, name, False, args.steps)
        rows = [("one process", base),
                ("mscale tp=2", max(run_distributed(_mscale, 2, name, False, args.steps))),
                ("mscale tp=2 sp", max(run_distributed(_mscale, 2, name, True, args.steps))),
                ("DTensor tp=2", max(run_distributed(_dtensor, 2, name, args.steps)))]
        for variant, ms in rows:
            print(f"{name:6} {variant:22} {ms:9.2f} {ms / base:6.2f}")


if __name__ == "__main__":
    main()
