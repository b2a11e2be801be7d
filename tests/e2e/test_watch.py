"""``mscale watch`` against real ``mscale train`` runs of 4 gloo processes (two 2-rank nodes).

- one rank slowed by ``--inject-delay``: caught live (watch beside the job) and ``--once`` after
  it, the right rank and node named, the checkpoint request honoured by the job before the node
  is quarantined;
- a healthy run raises nothing, live or once;
- a slow data loader (``--inject-data-delay``) and an uneven pipeline split (``stage_layers``)
  are attributed to their causes and nobody is quarantined;
- a rank killed mid-run (``--inject-crash``) ends a live watch with the reason and exit 2, as
  ``--once`` does, and the same command relaunched to a finish is healthy again.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from mscale.watch.findings import HARDWARE_CAUSES

from tests.conftest import REPO
from tests.e2e.train_run import MSCALE, mscale, records, small_plan

pytestmark = [pytest.mark.e2e, pytest.mark.timing]


def start_train(plan: str, run: Path, steps: int, *extra: str) -> subprocess.Popen:
    """A job in the background; returns once its run directory exists (watch needs it)."""
    proc = subprocess.Popen([MSCALE, "train", plan, "--local", "4", "--steps", str(steps),
                             "--ckpt-interval", "1000", "--run-dir", str(run), *extra],
                            cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not run.is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    return proc


def watch_live(run: Path, *args: str) -> subprocess.CompletedProcess:
    """Follow the job until its stop event (watch exits by itself)."""
    return mscale("watch", str(run), "--interval", "0.5", *args, timeout=240)


def finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out


def watch_events(run: Path) -> list[dict]:
    return [e for e in records(run / "events.jsonl") if e["source"] == "watch"]


def test_straggler_caught_live_and_once_checkpoint_before_quarantine(tmp_path):
    run = tmp_path / "run"
    job = start_train(small_plan(tmp_path), run, 40, "--inject-delay", "3:0.3")
    live = watch_live(run, "--jsonl")
    finish(job)
    found = [json.loads(line) for line in live.stdout.splitlines()]
    slow = [f for f in found if f["kind"] == "straggler"]
    assert slow and all(f["ranks"] == [3] and f["nodes"] == ["node2"] for f in slow), found
    assert slow[0]["cause"] in HARDWARE_CAUSES and slow[0]["slowdown_pct"] > 10
    # 0.3 s a step on a step of a few tenths: critical once it doubles the step (+100%)
    critical = any(f["severity"] == "critical" for f in slow)
    assert critical == any(f["slowdown_pct"] >= 100 for f in slow), slow
    assert live.returncode == (2 if critical else 1), live.stdout + live.stderr

    # the order in events.jsonl: finding → the job takes the request → it commits the
    # checkpoint → only then the quarantine
    events = records(run / "events.jsonl")
    at = {name: next(i for i, e in enumerate(events) if test(e)) for name, test in (
        ("finding", lambda e: e["source"] == "watch" and e["kind"] == "straggler"),
        ("request", lambda e: e["kind"] == "control" and e["evidence"].get("checkpoint")),
        ("ckpt", lambda e: e["kind"] == "checkpoint" and e["evidence"]["reason"] == "request"),
        ("quarantine", lambda e: e["source"] == "watch"
         and e["evidence"].get("action") == "quarantine"))}
    assert at["finding"] < at["request"] < at["ckpt"] < at["quarantine"], events
    ckpt = events[at["ckpt"]]
    [entry] = json.loads((run / "quarantine.json").read_text())["entries"]
    assert entry["node"] == "node2" and entry["since"] >= ckpt["time"]
    assert entry["evidence"]["checkpoint_confirmed"] is True
    assert entry["evidence"]["checkpoint"].endswith(f"ckpt/step-{ckpt['step']:06d}")
    assert entry["expires"] > entry["since"] and entry["reason"]
    assert not (run / "control" / "checkpoint").exists()  # consumed by the job

    # after the run, --once judges the same steps the same way, and records nothing twice
    page = tmp_path / "watch.html"
    once = mscale("watch", str(run), "--once", "--json", "--report", str(page))
    assert once.returncode in (1, 2), once.stdout + once.stderr
    doc = json.loads(once.stdout)
    assert any(f["ranks"] == [3] and f["nodes"] == ["node2"] and f["cause"] in HARDWARE_CAUSES
               for f in doc["findings"]), doc["findings"]
    # the live watch's finding and quarantine (and an escalation, if it rose), no more
    events = watch_events(run)
    rises = [e for e in events if e["message"].startswith("escalated to")]
    assert len(events) - len(rises) == 2 and len(rises) <= 1, events
    assert "node2" in page.read_text() and "<svg" in page.read_text()


def test_healthy_run_raises_nothing(tmp_path):
    run = tmp_path / "run"
    job = start_train(small_plan(tmp_path), run, 30)
    live = watch_live(run, "--json")
    finish(job)
    assert live.returncode == 0, live.stdout + live.stderr
    assert json.loads(live.stdout)["findings"] == []
    once = mscale("watch", str(run), "--once", "--json")
    assert once.returncode == 0 and json.loads(once.stdout)["findings"] == [], once.stdout
    assert watch_events(run) == [] and not (run / "quarantine.json").exists()


def pipeline_plan(tmp_path: Path) -> str:
    """pp 2 × dp 2 with 7 of 8 layers on the first stage; wide enough that compute, not the
    CPUs' scheduling noise, sets the pace. No TP, and 8 micro-batches of 1: the stages' compute
    is what differs, and without TP's collectives a step takes ~1 s on two cores (tp 2 × pp 2
    took ~3 s; 2 or 4 micro-batches of a larger size left the bubble, not the split, as the
    cost, and the imbalance unreported)."""
    path = small_plan(tmp_path, tp=1, pp=2, dp=2, micro_batch=1, sequence_parallel=False)
    data = yaml.safe_load(Path(path).read_text())
    data["model"].update(layers=8, hidden=256, ffn_hidden=1024)
    data["layout"]["stage_layers"] = [7, 1]
    Path(path).write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("case", ["slow_data", "stage_imbalance"])
def test_imbalance_attributed_to_its_cause_without_quarantine(tmp_path, case):
    run = tmp_path / "run"
    if case == "slow_data":  # rank 0 is TP rank 0: it reads and broadcasts to its TP peer
        job = start_train(small_plan(tmp_path), run, 30, "--inject-data-delay", "0:0.3")
    else:
        job = start_train(pipeline_plan(tmp_path), run, 24)
    finish(job)
    once = mscale("watch", str(run), "--once", "--json")
    assert once.returncode == 1, once.stdout + once.stderr
    slow = [f for f in json.loads(once.stdout)["findings"] if f["kind"] == "straggler"]
    assert [f["cause"] for f in slow] == [case], slow
    if case == "slow_data":
        assert slow[0]["ranks"] == [0] and slow[0]["nodes"] == ["node1"]
    else:  # the advice names a split of the 8 blocks that is faster than 7 + 1
        best = slow[0]["evidence"]["best_stage_layers"]
        assert sum(best) == 8 and best[0] < 7 and f"stage_layers {best}" in slow[0]["advice"]
    assert slow[0]["advice"] and slow[0]["slowdown_pct"] > 5
    assert not (run / "quarantine.json").exists()
    assert not any((run / "control").iterdir())
    [event] = watch_events(run)
    assert event["evidence"]["cause"] == case and event["evidence"]["action"] == "recorded"


def test_a_killed_rank_is_critical_live_and_once_until_a_relaunch_finishes(tmp_path):
    run, plan = tmp_path / "run", small_plan(tmp_path)
    line = "CRITICAL job stopped: rank 3 on node2 killed by SIGKILL (exit 3)"
    job = start_train(plan, run, 10, "--ckpt-interval", "2", "--inject-crash", "3:6")
    live = watch_live(run)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 3, out
    assert live.returncode == 2 and live.stdout.splitlines()[-1] == line, live.stdout + live.stderr
    once = mscale("watch", str(run), "--once", "--no-act")
    assert once.returncode == 2 and line in once.stdout.splitlines(), once.stdout + once.stderr
    doc = json.loads(mscale("watch", str(run), "--once", "--no-act", "--json").stdout)
    assert doc["exit_code"] == 2 and doc["summary"]["worst"] == "critical"
    assert doc["summary"]["job"]["exit_code"] == 3

    # the same command resumes from the newest checkpoint (the fault hooks act in attempt 1 only)
    again = mscale("train", plan, "--local", "4", "--steps", "10", "--ckpt-interval", "2",
                   "--run-dir", str(run), timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    once = mscale("watch", str(run), "--once", "--no-act", "--json")
    doc = json.loads(once.stdout)
    assert once.returncode == doc["exit_code"] == 0, once.stdout + once.stderr
    assert doc["summary"]["job"]["state"] == "finished" and doc["summary"]["job"]["attempt"] == 2
