"""The checks `bench/gpu_check.py` runs, each in its own process, in the order of `CHECKS`.

Every check prints lines, the last ones starting PASS / FAIL (a correctness check), INFO (a
figure, with its goal) or SKIP (with the reason). Figures: MFU and tokens/s from each run's
metrics.jsonl (median over the steps after the warm-up), the planner's predicted step time for the
same plan, mscale against a plain compiled PyTorch loop, compiled against eager. Correctness:
compiled and eager losses agree, no host sync inside the micro-batches, a fused attention kernel,
event timers against the wall clock, the GPU checkpoint round trip, hierarchical DP on NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpu_plans import (REPO, WARMUP, Context, NoFit, medians, plan_file, report_run,
                       train)


@dataclass
class Check:
    name: str
    seconds: int
    """Expected seconds on one H200 (compilation included): the budget skips what won't fit."""
    what: str
    run: Callable[[Context], bool] = field(repr=False)


# ----------------------------------------------------------------------------- the checks
def check_train_1b(ctx: Context) -> bool:
    return _train_and_report(ctx, plan_file(ctx, "plans/gpu-1b-h200.yaml"), "1b_compiled", 15)


def check_train_3b(ctx: Context) -> bool:
    try:
        plan = plan_file(ctx, "plans/gpu-3b-h200.yaml", layers=3 if ctx.rehearse else None)
    except NoFit as e:
        print(f"SKIP: {e}")
        return True
    return _train_and_report(ctx, plan, "3b_compiled", 12)


def _train_and_report(ctx: Context, plan: Path, name: str, steps: int) -> bool:
    records = train(ctx, plan, name, steps if not ctx.rehearse else 7)
    if records is not None:
        report_run(ctx, plan, records)
    return records is not None


def check_eager_1b(ctx: Context) -> bool:
    """The 1B plan eager: tokens/s against the compiled run, and the losses of the two runs
    (same seed, same data) step by step within 1% (bf16 kernels fused differently)."""
    plan = plan_file(ctx, "plans/gpu-1b-h200.yaml", compile=False, tag="-eager")
    compiled_file = ctx.out / f"{ctx.prefix}_1b_compiled_metrics.jsonl"
    if not compiled_file.exists():
        print("SKIP: the compiled 1B run (train-1b) left no metrics to compare with")
        return True
    compiled = [json.loads(line) for line in compiled_file.read_text().splitlines()]
    records = train(ctx, plan, "1b_eager", len(compiled))  # the same LR schedule
    if records is None:
        return False
    c, e = medians(compiled), medians(records)
    print(f"INFO: compiled {c['tokens_per_s']:,.0f} tokens/s, eager {e['tokens_per_s']:,.0f}: "
          f"compiled/eager {c['tokens_per_s'] / e['tokens_per_s']:.3f}")
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(compiled, records))
    ok = worst <= 0.01
    print(f"{'PASS' if ok else 'FAIL'}: compiled and eager losses agree over "
          f"{len(records)} steps: worst relative difference {worst:.2e} (limit 1e-2)")
    return ok


def check_reference(ctx: Context) -> bool:
    """bench/reference_loop.py on the same plan; mscale's tokens/s over its (goal >= 1.0)."""
    plan = plan_file(ctx, "plans/gpu-1b-h200.yaml")
    steps = 15 if not ctx.rehearse else 7
    proc = subprocess.run([sys.executable, "bench/reference_loop.py", str(plan), "--steps",
                           str(steps), "--warmup", str(WARMUP)], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        print(proc.stderr.strip()[-2000:])
        print(f"FAIL: reference_loop.py exited with {proc.returncode}")
        return False
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    (ctx.out / f"{ctx.prefix}_1b_reference.json").write_text(json.dumps(ref) + "\n")
    print(f"INFO: plain compiled PyTorch: {ref['tokens_per_s']:,.0f} tokens/s, median step "
          f"{ref['step_s']:.3f} s; loss {ref['losses'][0]:.3f} -> {ref['losses'][-1]:.3f}")
    ours_file = ctx.out / f"{ctx.prefix}_1b_compiled_metrics.jsonl"
    if ours_file.exists():
        ours = medians([json.loads(x) for x in ours_file.read_text().splitlines()])
        ratio = ours["tokens_per_s"] / ref["tokens_per_s"]
        print(f"INFO: mscale {ours['tokens_per_s']:,.0f} tokens/s / reference: {ratio:.3f} "
              f"(goal >= 1.0: {'met' if ratio >= 1.0 else 'NOT met'})")
    return True


def check_ckpt(ctx: Context) -> bool:
    """bench/gpu_ckpt_check.py: its own PASS/FAIL lines."""
    cmd = [sys.executable, "bench/gpu_ckpt_check.py", "--dir", str(ctx.work)]
    proc = subprocess.run(cmd + (["--cpu"] if ctx.rehearse else []), cwd=REPO, text=True,
                          env={**os.environ, "OUT": str(ctx.out)})
    return proc.returncode == 0


def _engine(ctx: Context, layers: int):
    """The 1B plan's engine in this process (world 1), at ``layers`` layers: the same block
    shapes as train-1b, so its compiled kernels come from inductor's cache."""
    from mscale.config.plan import load_plan
    from mscale.distributed.spawn import free_port
    from mscale.topology.env import LaunchEnv
    from mscale.train.engine import build_engine
    from mscale.train.options import TrainOptions

    plan = load_plan(str(plan_file(ctx, "plans/gpu-1b-h200.yaml", layers=layers, tag="-short")),
                     check=False)
    env = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                    master_addr="127.0.0.1", master_port=free_port(), launcher="bench",
                    hostname="localhost")
    return build_engine(plan, env, TrainOptions(run_dir="memory://unused", timeout_s=300))


def check_nosync(ctx: Context) -> bool:
    """No synchronizing CUDA call inside a step's micro-batches (`run_micro_batches` under
    ``torch.cuda.set_sync_debug_mode``), with a control that the detector sees float(loss)."""
    import time
    import warnings

    import torch
    from mscale.train.loop import train_step
    from mscale.train.step import run_micro_batches
    from mscale.train.timers import StepTimer

    engine = _engine(ctx, layers=4)
    timer = StepTimer(engine.device)
    for step in range(2):  # warm-up: compilation, allocations, autotuning
        timer.start_step()
        train_step(engine, step, timer)
        timer.end_step()
    cuda = engine.device.type == "cuda"

    def caught(fn):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                value = fn()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        return value, [str(w.message).splitlines()[0] for w in seen
                       if "synchroniz" in str(w.message)]

    timer.start_step()
    t0 = time.perf_counter()
    loss, syncs = caught(lambda: run_micro_batches(engine, 2, timer))
    host_s = time.perf_counter() - t0
    _, control = caught(lambda: float(loss))  # the detector sees a real read
    engine.grads.finish()
    engine.optimizer.step(1e-4, clip_coef=engine.optimizer.clip_coef(1.0))
    step_s = timer.end_step()["step"]
    print(f"INFO: run_micro_batches: {len(syncs)} synchronizing call(s) {syncs[:3]}; the host "
          f"returned after {host_s * 1e3:.1f} ms of a {step_s * 1e3:.1f} ms step; control "
          f"float(loss): {len(control)} seen; loss {float(loss):.4f} "
          f"({loss.dtype}, {loss.device})")
    if not cuda:
        print("SKIP: sync detection needs CUDA (the engine ran the step on the CPU)")
        return True
    ok = not syncs and bool(control) and loss.device.type == "cuda"
    print(f"{'PASS' if ok else 'FAIL'}: no host sync inside the micro-batches, the loss a "
          "device tensor")
    return ok


def check_sdpa(ctx: Context) -> bool:
    """SDPA runs a fused attention kernel (flash / cuDNN / memory-efficient), named from the
    profiler, forward and backward, at the 1B plan's attention shapes."""
    import re

    import torch
    from torch.profiler import ProfilerActivity, profile
    from mscale.model.transformer import attention_core

    cuda = torch.cuda.is_available()
    dev, (b, s) = ("cuda", (4, 2048)) if cuda else ("cpu", (2, 128))
    q = torch.randn(b, 16, s, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, 8, s, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    attention_core(q, k, v, None).sum().backward()  # warm-up
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        attention_core(q, k, v, None).sum().backward()
        if cuda:
            torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type.name == activity.name})
    fused = [n for n in names if re.search(r"flash|cudnn|fmha|efficient", n, re.IGNORECASE)]
    print("INFO: attention kernels: " + ("; ".join(fused) or "none fused among: "
                                         + "; ".join(names[:12])))
    print(f"{'PASS' if fused else 'FAIL'}: SDPA used a fused kernel"
          + ("" if cuda else " (CPU kernels: a rehearsal of the check, not the GPU's answer)"))
    return bool(fused)


CPU_MATMUL_SIDE = 512
"""The timers check's matrices on the CPU (tests use smaller ones)."""


def check_timers(ctx: Context) -> bool:
    """StepTimer against the wall clock around a step of known matmuls: the split is right and
    (on a GPU) the host leaves each region before the device finishes it (no per-region sync)."""
    import time

    import torch
    from mscale.distributed.collectives import COMM_CLOCK
    from mscale.train.timers import StepTimer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = 8192 if cuda else CPU_MATMUL_SIDE
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)

    def work(k):
        for _ in range(k):
            a @ a

    timer = StepTimer(dev)
    runs = []  # (timer's figures, host seconds per region) per step
    for _ in range(5):  # the first is a warm-up
        if cuda:
            torch.cuda.synchronize(dev)
        w0 = time.perf_counter()
        timer.start_step()
        work(20)
        d0 = time.perf_counter()
        with timer.region("data"):
            work(10)
        h0 = time.perf_counter()
        with timer.region("comm_wait"):
            with COMM_CLOCK.timed("tp"):  # nested: counted once, as comm_wait
                work(10)
        h1 = time.perf_counter()
        out = timer.end_step()
        wall = time.perf_counter() - w0
        runs.append((out, {"step": wall, "data": h0 - d0, "comm_wait": h1 - h0,
                           "compute": wall - (h1 - d0)}))
    runs = runs[1:]
    out, host = runs[-1]
    share = {k: out[k] / out["step"] for k in ("compute", "data", "comm_wait")}
    print(f"INFO: wall {host['step'] * 1e3:.2f} ms, timers: " + ", ".join(
        f"{k} {v * 1e3:.2f}" for k, v in out.items()) + f" ms; host time inside the comm "
        f"region {host['comm_wait'] * 1e3:.3f} ms")

    def agrees(k: str) -> bool:
        """The timer's ``k`` is the host clock's within 5% in one of the steps at least: a step
        preempted between the host's mark and the timer's is not the timer's fault, while a
        timer that loses or misplaces time disagrees in every step."""
        return any(abs(o[k] - h[k]) <= 0.05 * h[k] + 1e-3 for o, h in runs)

    step_ok = agrees("step")
    if cuda:
        # The matmuls' device times are fixed, so the split is known (50/25/25), and the host
        # must leave the comm region long before the device finishes it (no per-region sync).
        ok = (step_ok and abs(share["compute"] - 0.5) < 0.1 and abs(share["data"] - 0.25) < 0.05
              and abs(share["comm_wait"] - 0.25) < 0.05
              and host["comm_wait"] < 0.2 * out["comm_wait"])
        print(f"{'PASS' if ok else 'FAIL'}: step = wall within 5%, split 50/25/25 within 5-10 "
              "points, the host left the region before the device finished it")
        return ok
    # On the CPU the host runs every matmul, so each region's timer must equal the host's own
    # clock around it; the fixed split is not judged: on a shared CPU another process stalls
    # any region of any step, which says nothing about the timers.
    ok = step_ok and all(agrees(k) for k in ("compute", "data", "comm_wait"))
    print(f"{'PASS' if ok else 'FAIL'}: step and each region = the host's clock within 5% "
          "(CPU: the split and the no-sync half are judged on a GPU only)")
    return ok


def check_flight(ctx: Context) -> bool:
    """The flight recorder under the GPU backends ("cpu:gloo,cuda:nccl", world 1): which record
    holds the CUDA tensors' collectives (the dump's own entries, gloo's, or ``mscale_nccl``),
    and their states. recover compares the CPU record only so far (distributed/flight.py)."""
    import torch
    import torch.distributed as dist

    from mscale.distributed import flight
    from mscale.distributed.init import init_distributed
    from mscale.distributed.spawn import free_port
    from mscale.topology.env import LaunchEnv

    env = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                    master_addr="127.0.0.1", master_port=free_port(), launcher="bench",
                    hostname="localhost")
    init_distributed(env, timeout_s=60)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for _ in range(3):
        dist.all_reduce(torch.ones(8, device=device))
        dist.all_reduce(torch.ones(8))
    if device == "cuda":
        torch.cuda.synchronize()
    doc = flight.record() or {}
    own = [e.get("profiling_name") for e in doc.get("entries", [])]
    nccl = [(e.get("profiling_name"), e.get("state"))
            for e in (doc.get(flight.NCCL_KEY) or {}).get("entries", [])]
    print(f"INFO: flight record ({device}): own entries {own}; {flight.NCCL_KEY} {nccl}")
    found = len(own) + len(nccl) >= 6
    print(f"{'PASS' if found else 'FAIL'}: the 6 collectives are in the dump "
          f"({len(own)} in its entries, {len(nccl)} in {flight.NCCL_KEY})")
    return found


def check_nccl_dump(ctx: Context) -> bool:
    """bench/gpu_nccl_dump_check.py: torch's own dump when NCCL's watchdog ends a timed-out
    process lands under the run's logs/ and names the pending all-reduce (needs a GPU)."""
    import torch

    if ctx.rehearse or not torch.cuda.is_available():
        print("SKIP: an NCCL timeout needs a GPU")
        return True
    return subprocess.run([sys.executable, "bench/gpu_nccl_dump_check.py"],
                          cwd=REPO).returncode == 0


def check_hier_dp(ctx: Context) -> bool:
    """bench/gpu_hier_check.py when the machine has 4 GPUs (2 'nodes' x 2)."""
    import torch

    if ctx.rehearse or torch.cuda.device_count() < 4:
        print(f"SKIP: hierarchical DP needs 4 GPUs, this machine has {torch.cuda.device_count()}")
        return True
    return subprocess.run([sys.executable, "bench/gpu_hier_check.py"], cwd=REPO).returncode == 0


CHECKS = [  # the headline figures first; the cheap checks last still run if the budget allows
    Check("train-1b", 150, "mscale train plans/gpu-1b-h200.yaml, compiled: MFU, split, "
          "planner's prediction", check_train_1b),
    Check("train-3b", 150, "mscale train plans/gpu-3b-h200.yaml, compiled: MFU, prediction",
          check_train_3b),
    Check("reference", 150, "a plain compiled PyTorch loop of the 1B model; mscale / reference",
          check_reference),
    Check("nosync", 60, "no host sync inside a step's micro-batches (1B blocks, 4 layers)",
          check_nosync),
    Check("ckpt", 90, "checkpoints on the GPU: round trip bit-exact, async blocking ratio",
          check_ckpt),
    Check("eager-1b", 90, "the 1B plan eager: compiled/eager tokens/s, losses agree",
          check_eager_1b),
    Check("sdpa", 20, "SDPA runs a fused attention kernel", check_sdpa),
    Check("timers", 20, "event timers against the wall clock", check_timers),
    Check("flight", 20, "the flight recorder's dump holds the NCCL collectives", check_flight),
    Check("nccl-dump", 40, "torch's dump on an NCCL timeout: under the run's logs/, naming the "
          "all-reduce", check_nccl_dump),
    Check("hier-dp", 120, "hierarchical DP reduction on NCCL from one thread (4 GPUs)",
          check_hier_dp),
]


def run_one(name: str, ctx: Context) -> int:
    """Run one check in this process; exit code 1 when it failed."""
    check = next(c for c in CHECKS if c.name == name)
    try:
        ok = check.run(ctx)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0 if ok else 1
