"""Benchmark: time from a killed rank to the first resumed step, by phase, under supervise.

Not a test; prints figures (no pass/fail). Each round runs

    mscale recover supervise --backoff 0 -- mscale train PLAN --local 8 --run-dir RUN ...

on the cpu-tiny plan (8 gloo processes, tp2·pp2·dp2 on node[1-4]), waits for a few steps and
a committed checkpoint (a kill before the first one leaves nothing to resume), sends SIGKILL to
one worker from outside (the kill's wall time is known exactly), and reads the ``recover`` phase
events supervise wrote:

    kill → detect → diagnose → (back-off, 0 here) → restart → first resumed step → catch-up

``kill→known`` is the kill to the moment supervise knew (the launcher notices, stops the other
workers, writes its stop event and exits); ``first step`` is the kill to the first step the
relaunched job completed; ``total`` ends when the job passes the step it had reached at the kill
(the steps since the last checkpoint are trained again). Goal: first step < 60 s.

    .venv/bin/python bench/bench_recover.py                  # 3 rounds, world 8, kill rank 5
    .venv/bin/python bench/bench_recover.py --rounds 5 --rank 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MSCALE = str(Path(sys.executable).parent / "mscale")
PLAN = REPO / "src" / "mscale" / "presets" / "cpu-tiny.yaml"
sys.path.insert(0, str(REPO / "src"))
from mscale.distributed.launch import pid_file  # noqa: E402 - after the path is set


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []


def worker_pid(run: Path, rank: int) -> int | None:
    """The pid of this run's worker ``rank``, from the launcher's ``logs/rank<N>.pid`` (a forked
    worker's /proc/PID/environ is the fork server's, so its RANK cannot be read there)."""
    try:
        return int(Path(pid_file(str(run / "logs"), rank)).read_text())
    except (OSError, ValueError):
        return None


def one_round(work: Path, rank: int, kill_after: int, steps: int, interval: int) -> dict:
    run = work / "run"
    cmd = [MSCALE, "recover", "supervise", "--backoff", "0", "--interval", "0.2", "--",
           MSCALE, "train", str(PLAN), "--local", "8", "--steps", str(steps), "--ckpt-interval",
           str(interval), "--timeout", "20", "--run-dir", str(run), "--log-interval", "100"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while len(records(run / "metrics.jsonl")) < kill_after or not any(
            e["kind"] == "checkpoint" for e in records(run / "events.jsonl")):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the job ended before step {kill_after}: {proc.communicate()[1]}")
        time.sleep(0.05)
    pid = worker_pid(run, rank)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"supervise exited {proc.returncode}:\n{err}")
    evs = records(run / "events.jsonl")
    phase = {e["evidence"]["phase"]: e for e in evs
             if e["source"] == "recover" and "phase" in e.get("evidence", {})}
    starts = [e for e in evs if e["kind"] == "start"]
    first = next(r for r in records(run / "metrics.jsonl") if r["time"] >= starts[-1]["time"])
    known = phase["detect"]["evidence"]["ended_at"]
    return {"kill_to_known_s": known - killed_at,
            **{f"{p}_s": phase[p]["evidence"]["seconds"] for p in ("detect", "diagnose",
                                                                   "restart", "catch_up")},
            "kill_to_first_step_s": first["time"] - killed_at,
            "kill_to_caught_up_s": phase["catch_up"]["evidence"]["ended_at"] - killed_at,
            "resumed_step": first["step"] - 1, "failed_step": phase["detect"]["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=5, help="the worker killed")
    ap.add_argument("--kill-after", type=int, default=5, help="steps recorded before the kill")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt-interval", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-recover-") as work:
            rows.append(one_round(Path(work), args.rank, args.kill_after, args.steps,
                                  args.ckpt_interval))
        if not args.json:
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float)
                                                 else f"{k} {v}" for k, v in rows[-1].items()),
                  flush=True)
    keys = [k for k in rows[0] if k.endswith("_s")]
    summary = {k: {"median": statistics.median(r[k] for r in rows),
                   "min": min(r[k] for r in rows), "max": max(r[k] for r in rows)} for k in keys}
    if args.json:
        print(json.dumps({"rounds": rows, "summary": summary}, indent=2))
        return
    print(f"\nworld 8 (cpu-tiny), kill rank {args.rank} after step {args.kill_after}, "
          f"{args.rounds} rounds: median (min–max) seconds")
    for k in keys:
        s = summary[k]
        print(f"  {k:22s} {s['median']:6.2f} ({s['min']:.2f}–{s['max']:.2f})")
    met = summary["kill_to_first_step_s"]["max"] < 60
    print(f"  goal: kill_to_first_step_s < 60 in every round — {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
