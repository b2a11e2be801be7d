"""Benchmark: `mscale train` with the blocks compiled (``training.compile: true``, inductor) against
the same run eager, on one process.

The plan is cpu-tiny's model (or a wider one with ``--hidden``) on one process (tp1·pp1·dp1),
fp32; both runs start from the same seed, so their per-step losses must agree to float32
rounding (inductor fuses and reorders). Prints the median step time of each after the first
``--warmup`` steps (the compiled run's first step includes compiling), the ratio, the largest
relative loss difference, and the compiled run's first-step time. On a GPU this is where the
speed is (bench/gpu_check.sh); on CPUs inductor's gain is small, which is why
``training.compile`` defaults to off there. Not a test.

    .venv/bin/python bench/bench_compile.py                 # cpu-tiny's model, 20 steps
    .venv/bin/python bench/bench_compile.py --hidden 256 --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MSCALE = str(Path(sys.executable).with_name("mscale"))


def plan_for(root: Path, compiled: bool, hidden: int | None, steps: int) -> str:
    data = yaml.safe_load((REPO / "plans" / "cpu-tiny.yaml").read_text())
    data["cluster"].update(hostlist="node1", gpus_per_node=1)
    data["layout"].update(tp=1, pp=1, dp=1, sequence_parallel=False)
    data["training"].update(compile=compiled, steps=steps)
    if hidden:
        data["model"].update(hidden=hidden, ffn_hidden=4 * hidden)
    path = root / f"plan-{'compiled' if compiled else 'eager'}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run(root: Path, compiled: bool, args) -> list[dict]:
    run_dir = root / ("compiled" if compiled else "eager")
    p = subprocess.run([MSCALE, "train", plan_for(root, compiled, args.hidden, args.steps),
                        "--local", "1", "--run-dir", str(run_dir), "--no-final-ckpt"],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        sys.exit(f"mscale train ({'compiled' if compiled else 'eager'}) exited {p.returncode}:\n"
                 f"{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--hidden", type=int, default=None, help="model width (default cpu-tiny's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        eager, compiled = run(Path(tmp), False, args), run(Path(tmp), True, args)
    med = {name: statistics.median(r["step_time"][0] for r in recs[args.warmup:])
           for name, recs in (("eager", eager), ("compiled", compiled))}
    diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(eager, compiled))
    print(f"median step: eager {med['eager'] * 1e3:.1f} ms, compiled {med['compiled'] * 1e3:.1f} ms"
          f" (compiled / eager {med['compiled'] / med['eager']:.3f}); first compiled step "
          f"{compiled[0]['step_time'][0]:.1f} s; largest relative loss difference {diff:.1e} "
          f"over {len(eager)} steps")


if __name__ == "__main__":
    main()
