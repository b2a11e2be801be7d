"""The AdamW step over one rank's shard: torch's fused kernel (`optim.fused_adamw_`, the GPU
default) against the single-tensor sequence (`optim.adam_update_` after the decay multiply, the
CPU default), in the same process on the same tensors.

The step is memory-bound: the fused kernel moves ~7 shard-sized tensors, the sequence ~20. On a
GPU that is the optimizer's whole cost (bench/gpu_check.py measures the step, not this ratio);
on a CPU the ratio shows the same traffic argument at DRAM bandwidth.

    .venv/bin/python bench/bench_optim.py                  # 50 M parameters in 96 pieces
    .venv/bin/python bench/bench_optim.py --numel 10000000 --repeats 5

Prints one line per variant (median seconds over --repeats) and the ratio fused / sequence.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mscale.parallel import optim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--pieces", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    master, grad = torch.randn(args.numel, generator=g), torch.randn(args.numel, generator=g)
    m, v = torch.zeros(args.numel), torch.zeros(args.numel)
    cut = torch.linspace(0, args.numel, args.pieces + 1).long().tolist()

    def views(t):
        return [t[a:b] for a, b in zip(cut, cut[1:])]

    decay = list(range(0, args.pieces, 2))  # half the pieces decay, as matrices vs norms
    step_t = torch.zeros(())

    def sequence(step: int) -> None:
        torch._foreach_mul_([views(master)[i] for i in decay], 1 - 1e-4 * 0.1)
        optim.adam_update_(master, grad, m, v, step=step, lr=1e-4, beta1=0.9, beta2=0.95,
                           eps=1e-8)

    def fused(step: int) -> None:
        step_t.fill_(step)
        vs = [views(t) for t in (master, grad, m, v)]
        for wd, idx in ((0.1, decay), (0.0, [i for i in range(args.pieces) if i not in decay])):
            optim.fused_adamw_(*([x[i] for i in idx] for x in vs), step_t, lr=1e-4, beta1=0.9,
                               beta2=0.95, eps=1e-8, weight_decay=wd)

    times = {"sequence": [], "fused": []}
    for r in range(args.repeats + 1):  # alternate; the first round warms up and is dropped
        for name, fn in (("sequence", sequence), ("fused", fused)):
            t0 = time.perf_counter()
            fn(r + 1)
            if r:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, t in med.items():
        print(f"{k}: median {t * 1e3:.1f} ms per step over {args.numel / 1e6:.0f} M parameters "
              f"({args.repeats} repeats, {torch.get_num_threads()} threads)")
    print(f"fused / sequence: {med['fused'] / med['sequence']:.3f}")


if __name__ == "__main__":
    main()
