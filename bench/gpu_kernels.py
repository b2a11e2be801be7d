"""Measure what the planner's kernel model (`mscale.planner.kernels`) assumes, on one GPU.

Run ON a device machine (needs only torch with CUDA); writes one JSON document:

    python3 bench/gpu_kernels.py --out $OUT/kernels.json [--quick]

- GEMMs of a transformer block after the TP split (QKV, attention output, MLP up, MLP down) for
  hidden 2048-12288, tp 1-8, 2048 and 8192 tokens, in the forward (x·Wᵀ) and weight-gradient
  (dyᵀ·x, the token count becomes the reduction) orientations; bf16, achieved TFLOP/s.
- Attention core (torch SDPA, causal, bf16) forward + backward by head dim and sequence length,
  reported as FLOPs the planner counts (4·s²·d per head forward, no causal halving) per second.
- Memory-bound ops (add, layer norm forward + backward, GELU) as bytes moved per second.
- Unfused attention (baddbmm, softmax, dropout, bmm) forward + backward, and its GEMMs alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def _time(fn, budget_s: float = 0.05) -> float:
    """Median seconds of ``fn`` over enough repeats to fill ``budget_s`` (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(3, min(50, int(budget_s / one)))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def gemms(quick: bool) -> list[dict]:
    out = []
    hs = (2048, 4096, 8192) if quick else (2048, 4096, 8192, 12288)
    for tokens in (2048, 8192):
        for h in hs:
            for tp in (1, 2, 4, 8):
                for name, n, k in (("qkv", 3 * h // tp, h), ("proj", h, h // tp),
                                   ("fc1", 4 * h // tp, h), ("fc2", h, 4 * h // tp)):
                    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
                    flops = 2.0 * tokens * n * k
                    for orient, fn in (("fwd", lambda: x @ w.t()), ("wgrad", lambda: dy.t() @ x)):
                        t = _time(fn)
                        out.append({"op": name, "orient": orient, "tokens": tokens, "h": h,
                                    "tp": tp, "m": tokens if orient == "fwd" else n,
                                    "n": n if orient == "fwd" else k,
                                    "k": k if orient == "fwd" else tokens,
                                    "s": t, "tflops": flops / t / 1e12})
                    del x, w, dy
    for size in (4096, 8192, 16384):
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        t = _time(lambda: a @ a)
        out.append({"op": "square", "orient": "fwd", "m": size, "n": size, "k": size, "s": t,
                    "tflops": 2.0 * size**3 / t / 1e12})
    return out


def attention(quick: bool) -> list[dict]:
    out = []
    for d in (64, 128):
        for s in ((2048, 8192) if quick else (1024, 2048, 4096, 8192)):
            heads = 2048 // d
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            g = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)

            def fwd_bwd():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(g)

            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            counted = 4.0 * s * s * d * heads * b  # forward, the planner's count
            t_f, t_fb = _time(fwd), _time(fwd_bwd)
            out.append({"d": d, "s": s, "heads": heads, "batch": b, "fwd_s": t_f,
                        "fwd_bwd_s": t_fb, "fwd_tflops": counted / t_f / 1e12,
                        "fwd_bwd_tflops": 3 * counted / t_fb / 1e12})
    return out


def unfused_attention() -> list[dict]:
    """Attention as Megatron-LM ran it before flash kernels: QKᵀ (baddbmm), softmax, dropout,
    A·V (bmm), forward + backward; and the two batched GEMMs alone, to separate the score
    traffic."""
    out = []
    for d, width in ((96, 2304), (128, 4096), (128, 6144)):
        s, b = 2048, 1
        bh = b * width // d
        q, k, v = (torch.randn(bh, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(bh, s, d, device="cuda", dtype=torch.bfloat16)

        def full():
            sc = torch.baddbmm(torch.empty(bh, s, s, device="cuda", dtype=torch.bfloat16), q,
                               k.transpose(1, 2), beta=0.0, alpha=d ** -0.5)
            p = F.dropout(torch.softmax(sc, dim=-1), 0.1, training=True)
            torch.bmm(p, v).backward(g)

        pp = torch.randn(bh, s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def gemms():
            sc = torch.bmm(q, k.transpose(1, 2))
            o = torch.bmm(pp, v)
            torch.autograd.backward([sc, o], [torch.ones_like(sc), g])

        counted = 4.0 * s * s * width * b
        t_full, t_gemm = _time(full), _time(gemms)
        out.append({"d": d, "width": width, "s": s, "full_fwd_bwd_s": t_full,
                    "gemms_fwd_bwd_s": t_gemm, "scores": bh * s * s,
                    "full_tflops": 3 * counted / t_full / 1e12})
        del q, k, v, g, pp
    return out


def memory_ops() -> list[dict]:
    out = []
    for tokens, h in ((8192, 4096), (8192, 12288)):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ln = torch.nn.LayerNorm(h, device="cuda", dtype=torch.bfloat16)
        nbytes = x.numel() * 2
        t = _time(lambda: x.detach() + y)
        out.append({"op": "add", "tokens": tokens, "h": h, "bytes": 3 * nbytes, "s": t,
                    "gb_per_s": 3 * nbytes / t / 1e9})
        t = _time(lambda: F.gelu(x.detach()))
        out.append({"op": "gelu", "tokens": tokens, "h": h, "bytes": 2 * nbytes, "s": t,
                    "gb_per_s": 2 * nbytes / t / 1e9})

        def ln_fb():
            ln(x).backward(y)

        t = _time(ln_fb)  # forward reads x, writes y; backward reads x, dy, writes dx
        out.append({"op": "layernorm_fwd_bwd", "tokens": tokens, "h": h, "bytes": 5 * nbytes,
                    "s": t, "gb_per_s": 5 * nbytes / t / 1e9})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-unfused", action="store_true", help="only the unfused attention")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    t0 = time.time()
    if args.only_unfused:
        doc["unfused_attention"] = unfused_attention()
        print(json.dumps(doc["unfused_attention"], indent=1))
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        return
    doc["gemm"] = gemms(args.quick)
    doc["attention"] = attention(args.quick)
    doc["memory"] = memory_ops()
    doc["unfused_attention"] = unfused_attention()
    doc["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    sq = [g["tflops"] for g in doc["gemm"] if g["op"] == "square"]
    print(doc["device"], f"{doc['seconds']:.0f} s; square GEMM TFLOP/s {sq}")
    for a in doc["attention"]:
        print(f"attn d{a['d']} s{a['s']}: fwd {a['fwd_tflops']:.0f} "
              f"fwd+bwd {a['fwd_bwd_tflops']:.0f}")
    for u in doc["unfused_attention"]:
        print(f"unfused d{u['d']} w{u['width']}: {u['full_tflops']:.0f} TFLOP/s counted, "
              f"full {u['full_fwd_bwd_s'] * 1e3:.2f} ms, gemms {u['gemms_fwd_bwd_s'] * 1e3:.2f} ms")
    for m in doc["memory"]:
        print(f"{m['op']} {m['tokens']}x{m['h']}: {m['gb_per_s']:.0f} GB/s")


if __name__ == "__main__":
    main()
