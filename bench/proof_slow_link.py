"""Repeated end-to-end proof of the slow-link path on the 8-process CPU demo (docs/benchmarks.md).

A slow link made from outside mscale (tests/faults/slowlink.c: an LD_PRELOAD shim pacing the
socket writes of one node's processes, every one (``scope="all"``: its in-node TP traffic
too, the fault these figures were first measured with), selected by ``MSCALE_NODE`` as SLURM's
would be by
``SLURMD_NODENAME``; no flag of ``train``) starts after a clean stretch of steps. Under
``mscale recover supervise --watch`` the job must: name the paced node ``slow_link``
within 20 steps of the onset, commit a checkpoint, quarantine that node, relaunch without it and
finish every step with the losses of an uninterrupted run (layout-invariant engine, rel 1e-4).
Healthy runs (no shim) under the same supervisor must name no rank or node at all.

    .venv/bin/python bench/proof_slow_link.py --runs 3 --healthy 10 --out /tmp/proof

The demo is tp 2 x pp 2 x dp 2 on node[1-4], two ranks a node (tp fastest, then dp, then pp), so
node1 = ranks 0-1 (stage 0), node2 = 2-3 (stage 0), node3 = 4-5 (stage 1), node4 = 6-7 (stage 1):
the slowed nodes cover both stages and different TP groups. Both processes of the node share
its (paced) network, as on a machine. One line per run, a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mscale.runs.atomic import read_jsonl  # noqa: E402
from tests.faults import slowlink  # noqa: E402  (the shim lives with the tests)

MSCALE = str(REPO / ".venv" / "bin" / "mscale")
TARGETS = {"node3": "stage 1", "node1": "stage 0", "node4": "stage 1, another TP group"}
STEPS, ONSET = 40, 10
BPS = 5_000_000


def records(path: Path) -> list[dict]:
    return read_jsonl(str(path))  # a file being appended: a torn last line is skipped


def supervised(run: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [MSCALE, "recover", "supervise", "--backoff", "0", "--ckpt-wait", "120", "--",
           MSCALE, "train", "--local", "8", "--steps", str(STEPS), "--ckpt-interval", "1000",
           "--run-dir", str(run)]
    return subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=timeout)


def last_losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in records(run / "metrics.jsonl"):
        out[r["step"]] = r["loss"]
    return out


def judge_slow(run: Path, p, node: str, reference: dict[int, float]) -> dict:
    evs = records(run / "events.jsonl")
    found = [e for e in evs if e["source"] == "watch" and e["kind"] == "straggler"]
    named = [e.get("nodes") for e in found]
    first = found[0] if found else None
    detected = first["evidence"].get("detected_at", first["step"]) if first else None
    quarantined = [q["node"] for q in json.loads((run / "quarantine.json").read_text())
                   ["entries"]] if (run / "quarantine.json").exists() else []
    starts = [e for e in evs if e["kind"] == "start"]
    relaunch = starts[1]["evidence"]["launch"]["nodes"] if len(starts) > 1 else None
    losses = last_losses(run)
    worst = max((abs(losses[s] - v) / abs(v) for s, v in reference.items() if s in losses),
                default=float("inf"))
    ok = (p.returncode == 0 and first is not None
          and first["evidence"].get("cause") == "slow_link"
          and quarantined == [node] and relaunch is not None and node not in relaunch
          and detected is not None and detected - ONSET <= 20
          and set(losses) >= set(range(1, STEPS + 1)) and worst <= 1e-4)
    return {"case": f"slow link on {node} ({TARGETS[node]})", "ok": ok, "rc": p.returncode,
            "cause": first["evidence"].get("cause") if first else None, "named": named[:3],
            "detected_at": detected, "onset": ONSET, "quarantined": quarantined,
            "relaunch_nodes": relaunch, "max_rel_loss_diff": worst}


def judge_healthy(run: Path, p) -> dict:
    evs = records(run / "events.jsonl")
    blamed = [e for e in evs if e["source"] == "watch" and e["kind"] == "straggler"
              and (e.get("nodes") or e.get("ranks"))]
    quarantined = (run / "quarantine.json").exists() and json.loads(
        (run / "quarantine.json").read_text())["entries"]
    ok = p.returncode == 0 and not blamed and not quarantined
    return {"case": "healthy", "ok": ok, "rc": p.returncode,
            "blamed": [e["message"] for e in blamed][:3], "quarantined": quarantined or []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per slowed node")
    ap.add_argument("--healthy", type=int, default=10, help="healthy runs")
    ap.add_argument("--out", type=Path, default=Path("/tmp/proof_slow_link"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shim = slowlink.build(args.out / "shim")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLOWLINK_")}
    t0 = time.monotonic()
    ref_run = args.out / "reference"
    p = supervised(ref_run, base)
    reference = last_losses(ref_run)
    results = [judge_healthy(ref_run, p)]
    print(json.dumps(results[-1]), flush=True)
    for i in range(args.runs):
        for node in TARGETS:
            run, flag = args.out / f"slow-{node}-{i}", args.out / f"onset-{node}-{i}"
            # the fault follows the node (its NIC), not a rank number: the relaunch renumbers
            env = {**base, **slowlink.env(shim, f"MSCALE_NODE={node}", BPS, flag, scope="all")}
            with slowlink.onset_after_step(run, ONSET, flag):
                p = supervised(run, env)
            results.append(judge_slow(run, p, node, reference))
            print(json.dumps(results[-1]), flush=True)
    for i in range(args.healthy - 1):  # the reference run was the first healthy one
        run = args.out / f"healthy-{i}"
        results.append(judge_healthy(run, supervised(run, base)))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{sum(r['ok'] for r in results)}/{len(results)} runs as expected "
          f"in {time.monotonic() - t0:.0f} s")
    for case in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == case]
        print(f"  {case}: {sum(r['ok'] for r in rows)}/{len(rows)}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
