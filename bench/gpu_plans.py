"""What `bench/gpu_checks.py`'s checks run on: the GPU found (its preset), the committed H200
plans as a check needs them (retargeted to that GPU, compiled or not, fewer layers, or shrunk
for a rehearsal on the CPU), ``mscale train`` runs of them and their figures (medians after the
warm-up, the planner's prediction). Apart from the checks so that each file has one job.
"""

from __future__ import annotations

import copy
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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

