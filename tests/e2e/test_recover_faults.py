"""Faults a supervised job comes back from: ``mscale recover supervise -- mscale train … --local 4``

Each case injects one fault into attempt 1 of a tiny 4-process run (tp2·dp2 on node[1-2]) and
asserts what the issue asks of a recovery:

- the job ends trained (supervise exits 0 and the last step is reached);
- it resumed from the right checkpoint: the newest one that was committed before the fault and
  is usable (the ``resumed from`` event of the last attempt names it);
- the losses after the resume equal those of an uninterrupted reference run at the same steps
  (exactly on the same layout; to float noise when the job was re-planned onto fewer ranks);
- nothing was lost: every checkpoint any attempt committed is still there (in place, or moved
  aside as ``abandoned-…`` by a rollback), retention being set to keep them all;
- each recovery's phases are timed in ``events.jsonl``.

The references are module-scoped: one uninterrupted run per step count, shared by every case.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from mscale.recover.diagnose import flight
from tests.e2e.train_run import MSCALE, mscale, records, small_plan
from tests.faults import slowlink

pytestmark = pytest.mark.e2e

STEPS, INTERVAL = 12, 3
TRAIN = ["--local", "4", "--steps", str(STEPS), "--ckpt-interval", str(INTERVAL),
         "--ckpt-keep", "20", "--timeout", "10", "--log-interval", "4"]
"""Every case's train arguments (the reference's too): checkpoints at 3, 6, 9, 12."""
PHASES = ["detect", "diagnose", "restart", "catch_up", "total"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    return small_plan(tmp_path_factory.mktemp("plan"))


@pytest.fixture(scope="module")
def reference(plan, tmp_path_factory) -> dict[int, float]:
    """Loss per step of an uninterrupted run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    p = mscale("train", plan, *TRAIN, "--run-dir", str(run), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return {r["step"]: r["loss"] for r in records(run / "metrics.jsonl")}


def supervise_cmd(plan: str, run: Path, *train: str, sup: tuple[str, ...] = ()) -> list[str]:
    return [MSCALE, "recover", "supervise", "--backoff", "0", "--interval", "0.2", *sup, "--",
            MSCALE, "train", plan, *TRAIN, "--run-dir", str(run), *train]


def supervise(plan: str, run: Path, *train: str, sup: tuple[str, ...] = (),
              env: dict[str, str] | None = None):
    p = subprocess.run(supervise_cmd(plan, run, *train, sup=sup), text=True,
                       capture_output=True, timeout=150, env=env)
    return p


def committed_before_fault(run: Path) -> list[int]:
    """Steps of the checkpoints attempt 1 committed (its ``checkpoint`` events)."""
    evs = records(run / "events.jsonl")
    second = [i for i, e in enumerate(evs) if e["kind"] == "start"][1:]
    first = evs[:second[0]] if second else evs
    return [e["step"] for e in first if e["kind"] == "checkpoint" and e["source"] == "train"]


def check_recovered(run: Path, p, reference: dict[int, float], resumed: int,
                    rel: float = 0.0) -> list[dict]:
    """Every assertion of the module docstring; returns the recover phase events."""
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    evs = records(run / "events.jsonl")
    last_start = max(i for i, e in enumerate(evs) if e["kind"] == "start")
    resumes = [e for e in evs[last_start:] if e["message"].startswith("resumed from")]
    assert resumes and resumes[0]["evidence"]["path"].endswith(f"ckpt/step-{resumed:06d}"), out
    stop = [e for e in evs[last_start:] if e["kind"] == "stop" and e["source"] == "train"]
    assert stop and stop[-1]["evidence"]["code"] == 0, stop

    last: dict[int, float] = {}
    for r in records(run / "metrics.jsonl"):  # the last attempt's value of each step wins
        last[r["step"]] = r["loss"]
    after = range(resumed + 1, STEPS + 1)
    assert [last[s] for s in after] == pytest.approx([reference[s] for s in after],
                                                     rel=rel, abs=0), out

    saved = {e["step"] for e in evs if e["kind"] == "checkpoint" and e["source"] == "train"}
    ckpt = run / "ckpt"
    present = {int(d.name.split("step-")[1][:6]) for d in ckpt.iterdir()
               if "step-" in d.name and (d / "COMMITTED").exists()}
    assert saved <= present, f"committed {sorted(saved)}, left {sorted(present)}"

    phases = [e for e in evs if e["source"] == "recover" and e["kind"] == "recover"
              and "phase" in e["evidence"]]
    names = [e["evidence"]["phase"] for e in phases]
    assert names[-5:] == PHASES, names
    assert all(e["evidence"]["seconds"] is not None and e["evidence"]["seconds"] >= 0
               for e in phases[-5:]), phases
    return phases


def wait_for_checkpoint(proc: subprocess.Popen, run: Path, step: int) -> None:
    events, deadline = run / "events.jsonl", time.monotonic() + 60
    while not (events.exists() and any(
            e["kind"] == "checkpoint" and e["step"] == step for e in records(events))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def test_kill_9_mid_step(plan, reference, tmp_path):
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-crash", "2:5")
    check_recovered(run, p, reference, resumed=max(committed_before_fault(run)))
    assert "killed by SIGKILL" in p.stdout + p.stderr


def test_sigstop_hang(plan, reference, tmp_path):
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-hang", "1:5", "--timeout", "5")
    check_recovered(run, p, reference, resumed=max(committed_before_fault(run)))
    hang = [e for e in records(run / "events.jsonl") if e["kind"] == "hang"]
    assert hang and hang[0]["ranks"] == [1], hang
    # what names it under srun, where no launcher watches the workers: the flight records its
    # peers dumped as they timed out (rank 1, stopped, wrote none)
    dumps = {int(f.stem.rsplit("rank", 1)[1]): json.loads(f.read_text())
             for f in (run / "logs").glob("flight_recorder_rank*.json")}
    assert 1 not in dumps and len(dumps) >= 2, sorted(dumps)
    assert flight.culprits(dumps) == [1]


def test_nan_at_step_k_rolls_back_before_it(plan, reference, tmp_path):
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-nan", "5")
    good = [s for s in committed_before_fault(run) if s < 5]
    check_recovered(run, p, reference, resumed=max(good))


def flip_an_optimizer_byte(ckpt: Path) -> None:
    """Flip one byte inside the first chunk of an optimizer tensor (every resume reads those;
    under ZeRO 1 nobody reads the model tensors): the size stays, so only a full verify or the
    load itself sees it."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    shard, s = next((sh, s) for sh in manifest["shards"]
                    for s in json.loads((ckpt / sh["index"]["path"]).read_text())["slices"]
                    if s["tensor"].startswith("optim."))
    with open(ckpt / shard["path"], "r+b") as f:
        f.seek(s["offset"] + s["chunks"][0][0] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_latest_checkpoint_corrupted_then_a_crash(plan, reference, tmp_path, damage):
    """Step 6 is committed, then one of its shards is damaged, then rank 2 dies in step 9: the
    recovery must pass over step 6 and resume from step 3. Cut short, the shard fails quick
    verification; with one byte flipped it passes it, the relaunch from step 6 fails reading it
    (exit 3, bad_input naming the chunk), and the next recovery rolls back past it: a damaged
    checkpoint, not bad input, and no node kept out."""
    run = tmp_path / "run"
    proc = subprocess.Popen(supervise_cmd(plan, run, "--inject-crash", "2:9"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_checkpoint(proc, run, 6)
        if damage == "flipped":
            flip_an_optimizer_byte(run / "ckpt" / "step-000006")
        else:
            shard = max((f for f in (run / "ckpt" / "step-000006").rglob("*")
                         if f.is_file() and f.name not in ("manifest.json", "COMMITTED")),
                        key=lambda f: f.stat().st_size)
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        out, err = proc.communicate(timeout=150)
    finally:
        proc.kill() if proc.poll() is None else None
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    check_recovered(run, p, reference, resumed=3)
    assert any(d.name.startswith("abandoned-step-000006") or d.name == "step-000006"
               for d in (run / "ckpt").iterdir())
    if damage == "flipped":
        decisions = [json.loads(f.read_text()) for f in sorted((run / "recover").glob(
            "decision-*.json"))]
        last = decisions[-1]
        assert last["diagnosis"]["symptom"] == "damaged_checkpoint", last["diagnosis"]
        assert last["verdict"] == "degraded" and last["exclusions"]["nodes"] == []
        assert last["checkpoint"]["rejected"][0]["why"].startswith(
            "the relaunch failed reading it: "), last["checkpoint"]


def test_kill_during_a_checkpoint_write(plan, reference, tmp_path):
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-ckpt-kill", "1:6")
    check_recovered(run, p, reference, resumed=3)
    assert 6 not in committed_before_fault(run)


def test_enospc_on_the_checkpoint_filesystem(plan, reference, tmp_path):
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-ckpt-enospc", "6")
    evs = records(run / "events.jsonl")
    failed = [e for e in evs if e["kind"] == "checkpoint_failed"]
    assert failed and failed[0]["step"] == 6, evs
    check_recovered(run, p, reference, resumed=max(s for s in committed_before_fault(run)))


@pytest.mark.timing
def test_slowed_rank_checkpoint_then_exclude_zero_steps_lost(plan, reference, tmp_path):
    """watch (in supervise) finds rank 1 slow, has the job checkpoint, quarantines node1;
    supervise halts the job at the next step boundary and relaunches it on node2 alone,
    re-planned for 2 ranks, from the halt's checkpoint: no step is trained twice. (Rank 1, not
    3: the relaunch keeps the command's hook flags, disarmed, and a 2-rank job has no rank 3.)"""
    run = tmp_path / "run"
    p = supervise(plan, run, "--inject-delay", "1:0.4",
                  sup=("--watch-set", "warmup_steps=1", "--watch-set", "persist_steps=3",
                       "--watch-set", "baseline_steps=2", "--ckpt-wait", "30"))
    out = p.stdout + p.stderr
    evs = records(run / "events.jsonl")
    starts = [e for e in evs if e["kind"] == "start"]
    assert len(starts) == 2, out
    first_run = [r["step"] for r in records(run / "metrics.jsonl")]
    halted = max(committed_before_fault(run))
    # no step trained twice: the halt's step once (attempt 1), the next once (attempt 2)
    assert first_run.count(halted) == 1 and first_run.count(halted + 1) == 1, first_run
    check_recovered(run, p, reference, resumed=halted, rel=1e-5)
    entry = json.loads((run / "quarantine.json").read_text())["entries"]
    assert [e["node"] for e in entry] == ["node1"]
    assert entry[0]["evidence"]["checkpoint_confirmed"] is True
    assert starts[1]["evidence"]["layout"]["dp"] == 1  # re-planned: 2 ranks on node2
    assert starts[1]["evidence"]["launch"]["nodes"] == ["node2"]
    assert starts[1]["evidence"]["launch"]["local"] == 2
    assert (run / "plans" / "plan-0002.yaml").exists()
    detect = next(e for e in evs if e["source"] == "recover"
                  and e["evidence"].get("phase") == "detect")
    assert detect["evidence"]["failure_source"] == "quarantine.json: node1"


@pytest.mark.timing
def test_slow_link_checkpoint_then_exclude_zero_steps_lost(plan, reference, tmp_path):
    """Rank 3's socket writes are paced to 2 MB/s from step 3 on by an LD_PRELOAD shim (no flag
    of train: tests/faults/slowlink.c). watch (in supervise) names node2 as a slow link, the job
    checkpoints, node2 is quarantined, and the job is relaunched on node1 alone from that
    checkpoint: no step lost, the losses those of the uninterrupted run. The relaunched job has
    ranks 0 and 1 only, so the shim (which the relaunch inherits) selects nobody. Every socket
    write of rank 3 is paced (``scope="all"``), its node's TP traffic included: that is what
    names node2 here (a fault of its cross-node traffic only is test_slow_link.py's)."""
    run, onset = tmp_path / "run", tmp_path / "onset"
    env = {**os.environ, **slowlink.env(slowlink.build_for_test(tmp_path / "shim"), "RANK=3",
                                        2_000_000, onset, scope="all")}
    with slowlink.onset_after_step(run, 2, onset):
        p = supervise(plan, run, env=env,
                      sup=("--watch-set", "warmup_steps=1", "--watch-set", "persist_steps=3",
                           "--watch-set", "baseline_steps=2", "--ckpt-wait", "30"))
    out = p.stdout + p.stderr
    evs = records(run / "events.jsonl")
    found = [e for e in evs if e["source"] == "watch" and e["kind"] == "straggler"]
    assert found and found[0]["evidence"]["cause"] == "slow_link", out
    assert [e["node"] for e in json.loads((run / "quarantine.json").read_text())["entries"]] \
        == ["node2"], out
    halted = max(committed_before_fault(run))
    check_recovered(run, p, reference, resumed=halted, rel=1e-5)
    starts = [e for e in evs if e["kind"] == "start"]
    assert len(starts) == 2 and starts[1]["evidence"]["launch"]["nodes"] == ["node1"], out
