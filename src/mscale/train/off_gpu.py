"""A plan made for GPUs, run on a machine whose torch sees none: said at the start, and refused
before any worker starts when it cannot fit in the machine's memory.

Without this, ``mscale train plans/gpu-1b-h200.yaml --local 1`` on a laptop built a 0.9B model
on the CPU for half a minute, printed ``MFU 0.0%`` (its FLOPs against the H200's peak) or was
killed by the kernel's out-of-memory killer, and said neither why nor what to run instead.

The launcher imports no torch (docs/architecture.md), so the memory check asks the operating
system whether a GPU device exists (`gpus_visible`); the worker, which has torch, says the line
(`off_gpu_line`) wherever it finds itself on a CPU with a GPU plan (``--local``, srun, torchrun).
"""

from __future__ import annotations

import os

from mscale.config.plan import Plan
from mscale.errors import MscaleError

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")
"""The control devices of NVIDIA's and AMD's kernel drivers: without one, torch (CUDA or ROCm)
sees no GPU."""

CPU_PLAN = "plans/cpu-tiny.yaml"
"""A plan made for CPUs, named in the fix."""


def plans_for_gpus(plan: Plan) -> bool:
    return plan.cluster.gpu.name.lower() != "cpu"


def gpus_visible(environ=os.environ, exists=os.path.exists) -> bool:
    """Whether torch here could see a GPU: a driver's device exists and CUDA_VISIBLE_DEVICES does
    not hide them all. (True does not promise one: a CPU build of torch sees none either.)"""
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    return any(exists(p) for p in GPU_DEVICE_FILES)


def memory_available(path: str = "/proc/meminfo") -> int | None:
    """Bytes the kernel can give new allocations without swapping (MemAvailable); None off
    Linux."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def bytes_per_process(plan: Plan) -> float:
    """The planner's estimate of one process's peak (planner/memory.py: weights, gradients,
    optimizer states, activations), at the busiest pipeline rank."""
    from mscale.planner.cost import Problem, evaluate

    return float(evaluate(Problem(plan.model, plan.training, plan.cluster), plan.layout).mem_total)


def check_fits_without_gpus(plan: Plan, plan_path: str, nprocs: int, available=memory_available,
                            visible=gpus_visible) -> None:
    """Refuse a GPU plan's ``--local`` run on a machine with no GPU when its processes would
    need more memory than the machine has free: it would end in the out-of-memory killer's
    SIGKILL after minutes of building, not in a reason."""
    if not plans_for_gpus(plan) or visible():
        return
    free = available()
    if free is None:
        return
    from mscale.ckpt.listing import format_bytes

    each = bytes_per_process(plan)
    if each * nprocs <= free:
        return
    gpu = plan.cluster.gpu.name
    raise MscaleError(
        f"plan {plan.name} is for {gpu} GPUs and this machine has none, so its {nprocs} "
        f"process(es) would train on the CPUs: about {format_bytes(each)} each (the planner's "
        f"estimate), {format_bytes(each * nprocs)} in all, and {format_bytes(free)} is free",
        file=plan_path, field="cluster.gpu",
        fix=f"run it where its {gpu} GPUs are, or train a plan made for CPUs "
            f"(`mscale train {CPU_PLAN} --local 8 --run-dir runs/cpu-tiny`)")


def off_gpu_line(plan: Plan, device_type: str) -> str | None:
    """The start's note when a GPU plan trains on the CPU (None otherwise)."""
    if device_type != "cpu" or not plans_for_gpus(plan):
        return None
    gpu = plan.cluster.gpu.name
    return (f"note: plan {plan.name} is for {gpu} GPUs, but torch sees no GPU here: it trains "
            f"on the CPUs with gloo, slowly; MFU is measured against the {gpu}'s peak, so it "
            "reads near 0%")
