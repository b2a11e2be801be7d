"""Benchmark: a ``--local`` job's start, workers forked from the fork server against spawned.

Runs the same short job (``mscale train PLAN --local N --steps S``) alternately with the workers
forked from one server that imported torch once (the default, distributed/forkserver.py) and
spawned one interpreter each (``MSCALE_SPAWN_WORKERS=1``, the reference: how every worker
started before), and prints the wall time of the whole command and of each worker's start-up
phases (from ``logs/rank<N>.startup``), median over the repeats, and the ratios. Not a test.

    .venv/bin/python bench/bench_startup.py                       # cpu-tiny on 4 and 8 processes
    .venv/bin/python bench/bench_startup.py --procs 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MSCALE = str(Path(sys.executable).with_name("mscale"))


def plan_for(procs: int, root: Path) -> str:
    """cpu-tiny (tp2 pp2 dp2 on 8); on 4 processes tp2 dp2 over two 2-process nodes."""
    data = yaml.safe_load((REPO / "plans" / "cpu-tiny.yaml").read_text())
    if procs == 4:
        data["cluster"]["hostlist"] = "node[1-2]"
        data["layout"]["pp"] = 1
    path = root / f"plan{procs}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def ready_s(logs: Path, procs: int) -> float:
    """Seconds from the first worker's spawn to the last one's "ready" marker."""
    first, last = float("inf"), 0.0
    for rank in range(procs):
        marks = dict(line.split()[:2] for line in (logs / f"rank{rank}.startup").read_text()
                     .splitlines() if len(line.split()) >= 2)
        first = min(first, float(marks["spawned"]))
        last = max(last, float(marks["ready"]))
    return last - first


def one(plan: str, procs: int, steps: int, spawn: bool, root: Path) -> tuple[float, float]:
    run = Path(tempfile.mkdtemp(dir=root)) / "run"
    env = {**os.environ, "MSCALE_SPAWN_WORKERS": "1" if spawn else "0"}
    t0 = time.perf_counter()
    p = subprocess.run([MSCALE, "train", plan, "--local", str(procs), "--steps", str(steps),
                        "--run-dir", str(run), "--no-final-ckpt"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"mscale train failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return wall, ready_s(run / "logs", procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(tmp)
        for procs in args.procs:
            plan = plan_for(procs, root)
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for _ in range(args.repeats):  # alternate, so drift on the machine hits both
                for spawn in (True, False):
                    runs[spawn].append(one(plan, procs, args.steps, spawn, root))
            med = {k: (statistics.median(w for w, _ in v), statistics.median(r for _, r in v))
                   for k, v in runs.items()}
            (sw, sr), (fw, fr) = med[True], med[False]
            print(f"{procs} processes, {args.steps} steps, median of {args.repeats}: "
                  f"command {fw:.2f} s forked / {sw:.2f} s spawned = {fw / sw:.2f}; "
                  f"spawn-to-ready {fr:.2f} s / {sr:.2f} s = {fr / sr:.2f}", flush=True)


if __name__ == "__main__":
    main()
