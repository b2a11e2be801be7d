"""The reference for `mscale train` on one device: a plain PyTorch training loop, nanoGPT-style.

The same model (`mscale.model.Transformer`, the plain module with no engine around it) from a
plan, compiled whole with ``torch.compile``, fused AdamW, bf16 autocast when the plan says bf16,
micro-batches of the plan's size accumulated to its global batch, random tokens already on the
device (no data loading). What is left is what any single-device PyTorch user would write; the
engine must reach at least its tokens/s on the same plan (bench/gpu_check.sh compares the two).

    python3 bench/reference_loop.py plans/gpu-1b-h200.yaml --steps 30          # on a GPU
    .venv/bin/python bench/reference_loop.py plans/cpu-tiny.yaml --steps 6 --no-compile

Prints one JSON line: median step seconds and tokens/s over the steps after ``--warmup``, and the
losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    from mscale.config.plan import load_plan
    from mscale.model import Transformer, init_weights

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--no-compile", action="store_true", help="run the model eager")
    args = ap.parse_args()

    plan = load_plan(args.plan, check=False)
    cfg, training = plan.model, plan.training
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(training.seed)
    model = Transformer(cfg).to(device)
    init_weights(model, training.seed)
    step_fn = model if args.no_compile else torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, betas=(training.beta1,
                                  training.beta2), eps=training.eps,
                                  weight_decay=training.weight_decay, fused=True)
    micro = plan.layout.micro_batch
    accum = training.global_batch // micro  # one device: dp = 1
    bf16 = training.precision == "bf16"
    tokens = torch.randint(0, cfg.vocab, (accum, micro, cfg.seq_len + 1), device=device)

    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for j in range(accum):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = step_fn(tokens[j, :, :-1], tokens[j, :, 1:])
            (loss / accum).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total) / accum)  # one host sync per step, as the engine's metrics
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup:] or times)
    print(json.dumps(dict(step_s=step_s, tokens_per_s=training.global_batch * cfg.seq_len / step_s,
                          compiled=not args.no_compile, device=device.type, losses=losses)))


if __name__ == "__main__":
    main()
