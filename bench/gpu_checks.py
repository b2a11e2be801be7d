"""The checks `bench/gpu_check.py` runs, each in its own process, in the order of `CHECKS`.

Every check prints lines, the last ones starting PASS / FAIL (a correctness check), INFO (a
figure, with its goal) or SKIP (with the reason). Figures: MFU and tokens/s from each run's
metrics.jsonl (median over the steps after the warm-up), the planner's predicted step time for the
same plan, mscale against a plain compiled PyTorch loop, compiled against eager. Correctness:
compiled and eager losses agree, no host sync inside the micro-batches, a fused attention kernel,
event timers against the wall clock, the GPU checkpoint round trip, hierarchical DP on NCCL.
"""

from __future__ import annotations

import copy
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5
"""Steps left out of every median: the first builds kernels (compile, cuBLAS autotuning)."""
TINY_MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                  seq_len=64)
"""The model of a rehearsal on the CPU."""
PLANS_GPU = "H200"
"""The GPU of the committed plans the checks run (plans/gpu-1b-h200.yaml, gpu-3b-h200.yaml)."""


# ----------------------------------------------------------------------------- the GPU found
def gpu_preset(name: str, memory_mib: float) -> str | None:
    """The preset (src/mscale/config/gpus.py) of a GPU as nvidia-smi names it, or None when no
    preset has its peak: the PCIe and NVL parts of H100/H200 run slower clocks (756 and 835
    dense BF16 TFLOP/s against the SXM part's 989, NVIDIA's H100 and H200 datasheets), so an
    MFU against the SXM peak would flatter them."""
    if re.search(r"PCIe|NVL|GH200|GB200", name, re.IGNORECASE):  # GH200: 96 or 144 GB
        return None
    for preset in ("H200", "H800", "H100"):
        if preset in name:
            return preset
    if "A100" in name:
        return "A100-40GB" if memory_mib < 60_000 else "A100"
    return None


def detect_gpu() -> tuple[str, str | None] | None:
    """(nvidia-smi's name of GPU 0, its preset), or None on a machine without nvidia-smi.
    Asked of nvidia-smi, not torch: a CUDA context in the driver would hold GPU memory for
    every check."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out.strip():
        return None
    name, _, memory = out.splitlines()[0].rpartition(",")
    try:
        return name.strip(), gpu_preset(name.strip(), float(memory))
    except ValueError:  # memory "[N/A]"
        return name.strip(), gpu_preset(name.strip(), 1e9)


class NoFit(Exception):
    """The plan fits the GPU found in no layout (`retarget`)."""


def retarget(doc: dict, gpu: str) -> tuple[dict, str | None]:
    """The plan document ``doc`` moved to one ``gpu`` (a preset): the same model, training and
    batch. Its layout is kept where it fits the GPU's memory by the planner's estimate, else
    the planner's best single-GPU layout is taken (micro-batch, recompute); returns the new
    document and a note of a changed layout (None when kept). The 3B plan needs 96 GB at its
    4 sequences a micro-batch: it fits an H200 (141 GB), not an H100 (80 GB)."""
    from mscale.config.plan import Plan
    from mscale.planner.cost import Problem, evaluate
    from mscale.planner.search import describe, search

    doc = copy.deepcopy(doc)
    doc["cluster"] = {**doc["cluster"], "name": f"one-{gpu.lower()}", "gpu": gpu}
    doc["name"] = re.sub(f"-{PLANS_GPU.lower()}$", "", doc["name"]) + f"-{gpu.lower()}"
    for key in ("estimate", "checkpoint"):  # figures of the GPU the plan was written for
        doc.pop(key, None)
    plan = Plan.model_validate(doc)
    kept = evaluate(Problem(plan.model, plan.training, plan.cluster), plan.layout)
    if kept.fits:
        return doc, None
    free = plan.training.model_copy(update=dict(micro_batch=None, recompute=None,
                                                zero_stage=None))
    found = search(Problem(plan.model, free, plan.cluster))
    if not found.count:
        raise NoFit(f"{plan.name} fits one {gpu} in no layout: "
                    f"{kept.mem_total / 1e9:.1f} GB at {describe(plan.layout)}, against "
                    f"{kept.mem_budget / 1e9:.1f} GB usable")
    best = found.layout(0)
    doc["layout"].update(micro_batch=best.micro_batch, recompute=best.recompute,
                         zero_stage=best.zero_stage)
    for key in ("micro_batch", "recompute", "zero_stage"):
        doc["training"][key] = doc["layout"][key]
    return doc, (f"{describe(plan.layout)} needs {kept.mem_total / 1e9:.1f} GB, over the "
                 f"{kept.mem_budget / 1e9:.1f} GB usable on one {gpu}: the planner's best "
                 f"that fits, {describe(best)}, runs instead")


@dataclass
class Context:
    out: Path
    """Report and metrics files (copied back from the device)."""
    work: Path
    """Run directories and plans written for the checks (left on the machine)."""
    rehearse: bool = False
    """On the CPU with `TINY_MODEL`: the code paths, not the figures."""
    gpu: str | None = PLANS_GPU
    """The GPU preset the checks run on (`gpu_preset`); the plans are retargeted to it when it
    is not theirs (`retarget`). None: a GPU whose peak no preset knows; plans as written."""

    @property
    def prefix(self) -> str:
        """Name prefix of the files kept under ``out`` (bench/data/ keeps the GPU ones): the
        GPU's, so that figures of two cards are never mistaken for one another."""
        return "rehearsal" if self.rehearse else (self.gpu or "gpu").lower()


@dataclass
class Check:
    name: str
    seconds: int
    """Expected seconds on one H200 (compilation included): the budget skips what won't fit."""
    what: str
    run: Callable[[Context], bool] = field(repr=False)


# ----------------------------------------------------------------------------- plans and runs
def plan_file(ctx: Context, base: str, *, compile: bool | None = None, layers: int | None = None,
              tag: str = "") -> Path:
    """A plan file for a check: ``base`` as it is, or changed: retargeted to the GPU found
    (`retarget`), the compile switch, fewer layers, or in a rehearsal shrunk to `TINY_MODEL`
    (compiled, so the CPU rehearses the compiled path)."""
    other_gpu = ctx.gpu is not None and ctx.gpu != PLANS_GPU
    if compile is None and layers is None and not ctx.rehearse and not other_gpu:
        return REPO / base
    doc = yaml.safe_load((REPO / base).read_text())
    for key in ("estimate", "checkpoint"):  # figures of the plan as written: stale once changed
        doc.pop(key, None)
    if other_gpu:
        doc, note = retarget(doc, ctx.gpu)
        print(f"note: {Path(base).name} retargeted to one {ctx.gpu}"
              + (f"; {note}" if note else ", its layout kept (it fits)"), flush=True)
    if ctx.rehearse:
        doc["model"].update(TINY_MODEL)
        doc["training"].update(global_batch=8, precision="bf16")
        doc["training"]["compile"] = True if compile is None else compile
    elif compile is not None:
        doc["training"]["compile"] = compile
    if layers is not None:
        doc["model"]["layers"] = layers
    path = ctx.work / f"{Path(base).stem}{tag}{'-' + ctx.gpu.lower() if other_gpu else ''}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def train(ctx: Context, plan: Path, name: str, steps: int) -> list[dict] | None:
    """``mscale train PLAN --local 1``, no checkpoint (GBs, not what is measured); its records,
    or None when it failed. The metrics are copied to ``out`` as <prefix>_<name>_metrics.jsonl."""
    run_dir = ctx.work / f"run-{name}"
    cmd = [sys.executable, "-m", "mscale.cli.main", "train", str(plan), "--local", "1",
           "--steps", str(steps), "--run-dir", str(run_dir), "--log-interval", "5",
           "--no-final-ckpt", "--ckpt-interval", "1000000"]
    print("$ mscale " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(lines[-10:]), flush=True)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        print(f"FAIL: mscale train exited with {proc.returncode}")
        return None
    (ctx.out / f"{ctx.prefix}_{name}_metrics.jsonl").write_text(metrics.read_text())
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def medians(records: list[dict]) -> dict[str, float]:
    """Medians over the steps after `WARMUP` (all steps when there are no more)."""
    recs = records[WARMUP:] or records
    out = {k: statistics.median(r[k] for r in recs) for k in ("mfu", "tokens_per_s")}
    for k in ("step_time", "compute_time", "comm_wait", "data_time", "bubble_time"):
        out[k] = statistics.median(r[k][0] for r in recs)
    out["steps"] = f"{recs[0]['step']}..{recs[-1]['step']}"
    return out


def predicted_step_s(plan_path: Path) -> float:
    """The planner's step time for the plan's own layout (the stack its training file names)."""
    from mscale.config.plan import load_plan
    from mscale.planner.cost import Problem, evaluate

    plan = load_plan(str(plan_path), check=False)
    return evaluate(Problem(plan.model, plan.training, plan.cluster), plan.layout).step_time


def report_run(ctx: Context, plan: Path, records: list[dict], goal_mfu: float = 0.50) -> dict:
    """MFU, tokens/s, the split and the planner's prediction of one run, as INFO lines."""
    m = medians(records)
    print(f"INFO: steps {m['steps']}: median MFU {m['mfu']:.3f} (goal >= {goal_mfu:.2f}: "
          f"{'met' if m['mfu'] >= goal_mfu else 'NOT met'}), {m['tokens_per_s']:,.0f} tokens/s; "
          f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}")
    print("INFO: median split (event timers), ms: " + ", ".join(
        f"{k} {m[k] * 1e3:.1f}" for k in ("step_time", "compute_time", "comm_wait", "data_time",
                                          "bubble_time")))
    want = predicted_step_s(plan)
    ratio = m["step_time"] / want
    print(f"INFO: planner predicts {want:.4g} s per step, measured {m['step_time']:.4g} s: "
          f"measured/predicted {ratio:.3f} (goal within 10%: "
          f"{'met' if abs(ratio - 1) <= 0.10 else 'NOT met'})")
    return m


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
          f"float(loss): {len(control)} seen; loss {float(loss):.4f} ({loss.dtype}, {loss.device})")
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


def check_timers(ctx: Context) -> bool:
    """StepTimer against the wall clock around a step of known matmuls: the split is right and
    (on a GPU) the host leaves each region before the device finishes it (no per-region sync)."""
    import time

    import torch
    from mscale.distributed.collectives import COMM_CLOCK
    from mscale.train.timers import StepTimer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = 8192 if cuda else 512
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)

    def work(k):
        for _ in range(k):
            a @ a

    timer = StepTimer(dev)
    for _ in range(4):  # the last of four counts
        if cuda:
            torch.cuda.synchronize(dev)
        w0 = time.perf_counter()
        timer.start_step()
        work(20)
        with timer.region("data"):
            work(10)
        h0 = time.perf_counter()
        with timer.region("comm_wait"):
            with COMM_CLOCK.timed("tp"):  # nested: counted once, as comm_wait
                work(10)
        host_in_region = time.perf_counter() - h0
        out = timer.end_step()
        wall = time.perf_counter() - w0
    share = {k: out[k] / out["step"] for k in ("compute", "data", "comm_wait")}
    print(f"INFO: wall {wall * 1e3:.2f} ms, timers: " + ", ".join(
        f"{k} {v * 1e3:.2f}" for k, v in out.items()) + f" ms; host time inside the comm "
        f"region {host_in_region * 1e3:.3f} ms")
    ok = (abs(out["step"] - wall) <= 0.05 * wall + 1e-3 and abs(share["compute"] - 0.5) < 0.1
          and abs(share["data"] - 0.25) < 0.05 and abs(share["comm_wait"] - 0.25) < 0.05)
    if cuda:
        ok = ok and host_in_region < 0.2 * out["comm_wait"]
    print(f"{'PASS' if ok else 'FAIL'}: step = wall within 5%, split 50/25/25 within 5-10 points"
          + (", the host left the region before the device finished it" if cuda else
             " (CPU: the host waits for every matmul, the no-sync half is not checked)"))
    return ok


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
