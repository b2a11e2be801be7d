"""Fault hooks, data skips and the launch record of `mscale train` (without starting a job)."""

from __future__ import annotations

import time
import errno
import json
import signal

import pytest
import torch

from mscale.ckpt.writer import write_shard
from mscale.cli.options import build as build_options
from mscale.cli.train import launch_of
from mscale.config.records import DataSkip, DataSkips
from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.train import faults
from mscale.train.data import BatchPlan, DataLoader
from mscale.train.options import FaultPlan, TrainOptions
from mscale.train.session import launch_record, read_data_skips
from tests.e2e.train_run import small_plan


def armed_options(tmp_path) -> TrainOptions:
    return TrainOptions(run_dir=str(tmp_path), faults=FaultPlan(
        delay={1: 0.5}, data_delay={0: 0.1}, nan_step=3, crash={2: 4}, hang={3: 5},
        ckpt_enospc_step=2, ckpt_kill={1: 4}, ckpt_hang={0: 6}, ckpt_chunk_delay_s=0.1))


def test_options_survive_the_launchers_json_with_integer_ranks(tmp_path):
    opts = armed_options(tmp_path)
    back = TrainOptions.model_validate_json(opts.model_dump_json())
    assert back == opts
    assert back.faults.crash == {2: 4} and back.faults.ckpt_kill == {1: 4}


def test_write_hooks_of_a_rank_and_step():
    plan = armed_options("x").faults
    fault = {(r, s): getattr(faults.FaultHooks(plan, r, 2).write_hooks(s), "fault", None)
             for r in range(4) for s in range(1, 7)}
    assert fault[(1, 4)] == "kill" and fault[(0, 6)] == "hang"
    assert fault[(3, 2)] == "enospc" and fault[(1, 2)] == "enospc"
    assert fault[(1, 6)] is None and fault[(0, 4)] is None
    assert faults.FaultHooks(FaultPlan(), 0, 2).write_hooks(2) is None  # nothing to do


def test_a_later_attempt_installs_no_hook_the_checkpoint_delay_included(monkeypatch):
    """Attempt 2 and later: no model hook, the data read and the writer not slowed (an older
    disarm forgot the chunk delay)."""
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    plan = armed_options("x").faults
    first, later = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    first.has_head = later.has_head = True
    armed = faults.install(plan, 1, 2, [first])
    assert armed.armed and first._forward_pre_hooks and first._forward_hooks
    hooks = faults.install(plan, 1, 2, [later], attempt=2)
    assert not hooks.armed and not later._forward_pre_hooks and not later._forward_hooks
    read = lambda step, micro: (step, micro)  # noqa: E731
    assert hooks.wrap_get_batch(read) is read
    assert hooks.write_hooks(4) is None and hooks.write_hooks(2) is None
    later(torch.zeros(1, 2))
    assert slept == []


def test_slow_compute_and_data_spread_over_the_steps_forwards_and_reads(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    hooks = faults.install(FaultPlan(delay={0: 0.8}, data_delay={0: 0.4}), 0, 4, chunks)
    get = hooks.wrap_get_batch(lambda step, micro: None)
    for _ in range(4):
        for c in chunks:
            c(torch.zeros(1, 2))
        get(0, 0)
    assert sum(slept) == pytest.approx(0.8 + 0.4) and len(slept) == 12
    with torch.no_grad():  # the held-out evaluation is not slowed
        chunks[0](torch.zeros(1, 2))
    assert len(slept) == 12


def test_nan_poisons_the_training_loss_of_its_step_only():
    head = torch.nn.Linear(2, 1)
    head.has_head = True
    hooks = faults.install(FaultPlan(nan_step=2), 0, 1, [head])
    seen = []
    for step in range(3):
        hooks.begin_step(step)
        seen.append(bool(head(torch.ones(1, 2)).isnan().any()))
    assert seen == [False, True, False]
    with torch.no_grad():
        assert not head(torch.ones(1, 2)).isnan().any()


def test_step_fault_fires_once_on_its_step_after_a_forward(monkeypatch):
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    model = torch.nn.Linear(2, 2)
    plan = FaultPlan(crash={0: 2}, hang={1: 1})
    f = faults.install(plan, 0, 2, [model])
    for step in range(3):
        f.begin_step(step)
        for _ in range(2):  # two micro-batches
            model(torch.zeros(1, 2))
    assert sent == [signal.SIGKILL]
    other = torch.nn.Linear(2, 2)
    faults.install(plan, 3, 2, [other])  # a rank no hook names gets none
    assert not other._forward_hooks


def test_an_enospc_write_leaves_a_partial_shard_and_raises_oserror(tmp_path):
    from mscale.ckpt.snapshot import Snapshot

    class Item:
        key, box, flat = "t", [[0, 4096]], [0, 4096]

    data = torch.arange(4096, dtype=torch.float32).view(torch.uint8)  # 16 KiB: 4 chunks
    snap = Snapshot(items=[Item()], views=[data], seconds=0.0, nbytes=data.numel())
    with pytest.raises(OSError) as e:
        write_shard(str(tmp_path), 0, snap, "raw", 0, chunk_bytes=4096,
                    hooks=faults.CheckpointFaults("enospc"))
    assert e.value.errno == errno.ENOSPC and "inject-ckpt-enospc" in str(e.value)
    shard = tmp_path / "rank-00000.bin"
    assert shard.exists() and shard.stat().st_size == 4096  # the first chunk, flushed


@pytest.mark.parametrize("value", ["x", "1", "1:0", "1:2.5", "a:3"])
def test_bad_rank_step_hooks_are_refused(value):
    with pytest.raises(MscaleError) as e:
        build_options(TrainOptions, {"faults__crash": [value]}, run_dir="x")
    assert e.value.field == "--inject-crash"


def test_rank_step_hooks_parse():
    opts = build_options(TrainOptions, {"faults__hang": ["1:3", "2:10"]}, run_dir="x")
    assert opts.faults.hang == {1: 3, 2: 10}


def test_data_skips_absent_valid_and_damaged(tmp_path):
    run = RunDir(str(tmp_path))
    assert read_data_skips(run).entries == []
    doc = DataSkips(entries=[DataSkip(after_step=2, skip_steps=3, reason="spike")])
    (tmp_path / "data_skip.json").write_text(doc.model_dump_json())
    assert read_data_skips(run).sample_step(3) == 6
    for bad in ("{", '{"entries": [{"after_step": 1, "skip_steps": 0}]}'):
        (tmp_path / "data_skip.json").write_text(bad)
        with pytest.raises(MscaleError) as e:
            read_data_skips(run)
        assert e.value.file.endswith("data_skip.json")


class Counting:
    seq_len = 2

    def sample(self, k: int) -> torch.Tensor:
        return torch.full((3,), k)

    def batch(self, ks: list[int]) -> torch.Tensor:
        return torch.stack([self.sample(k) for k in ks])


def test_loader_reads_the_shifted_steps_samples():
    skips = DataSkips(entries=[DataSkip(after_step=1, skip_steps=2)])
    plan = BatchPlan(global_batch=4, micro_batch=2, dp_size=1, dp_rank=0)
    plain, skipping = DataLoader(Counting(), plan), DataLoader(Counting(), plan, skips=skips)
    assert torch.equal(skipping.get(0, 1)[0], plain.get(0, 1)[0])  # step 1: untouched
    assert torch.equal(skipping.get(1, 0)[0], plain.get(3, 0)[0])  # step 2 reads step 4's
    assert torch.equal(skipping.get(2, 1)[0], plain.get(4, 1)[0])


def _windows(*pairs, batch=None):
    return DataSkips(entries=[DataSkip(after_step=a, skip_steps=n, global_batch=batch)
                              for a, n in pairs])


@pytest.mark.parametrize("pairs", [(), ((0, 3),), ((1, 2), (6, 1)), ((2, 1), (2, 2), (5, 4))])
def test_resuming_anywhere_continues_the_uninterrupted_data(pairs):
    """A fresh run's step t starts at (sample_step(t+1) − 1) · batch, and a run resumed from
    any step k with the samples its checkpoint there records reads the same from k on. Windows
    recorded after k (a rollback to k writes one after the fact) move it; those before k are in
    the checkpoint's samples, or, for a manifest that counted step · batch only, added."""
    skips = _windows(*pairs)
    plan = BatchPlan(global_batch=4, micro_batch=2, dp_size=1, dp_rank=0)
    fresh = DataLoader(Counting(), plan, skips=skips)
    assert [fresh.start_of(t) for t in range(10)] == [
        (skips.sample_step(t + 1) - 1) * 4 for t in range(10)]
    for k in range(8):
        for samples, counts in ((fresh.consumed_before(k), True), (4 * k, False)):
            resumed = DataLoader(Counting(), plan, skips=skips)
            resumed.resume_from(k, samples, counts_skips=counts)
            assert [resumed.start_of(t) for t in range(k, 10)] == [
                fresh.start_of(t) for t in range(k, 10)], (k, counts)
            assert resumed.consumed_before(9) == fresh.consumed_before(9)


def test_a_new_batch_continues_from_the_samples_consumed():
    """64 samples consumed by 4 steps at batch 16, now batch 12, and a window of one step after
    the 5th: 0-based steps 4, 5, 6, 7 start at 64, 88 (76-87 skipped), 100, 112; each sample of
    a step is read once."""
    plan = BatchPlan(global_batch=12, micro_batch=2, dp_size=3, dp_rank=0)
    loader = DataLoader(Counting(), plan, skips=_windows((5, 1)))
    loader.resume_from(4, 64, counts_skips=True)
    assert [loader.start_of(t) for t in (4, 5, 6, 7)] == [64, 88, 100, 112]
    assert loader.consumed_before(5) == 76 and loader.consumed_before(6) == 100
    seen = []
    for d in range(3):
        ranked = BatchPlan(global_batch=12, micro_batch=2, dp_size=3, dp_rank=d)
        seen += [i for j in range(ranked.micro_batches)
                 for i in ranked.indices_from(loader.start_of(4), j)]
    assert sorted(seen) == list(range(64, 76))


def test_a_window_keeps_the_batch_it_was_recorded_at():
    """A rollback to step 4 at batch 16 skips the next two steps' samples (64-95); relaunched at
    batch 12 (the same recovery changed the batch), 0-based step 4 starts at 96, not at
    64 + 2·12 = 88, which would read 88-95 of the bad window again. An old manifest (step · batch) at step 6 of the
    batch-16 run counts the window at 16 too."""
    plan = BatchPlan(global_batch=12, micro_batch=2, dp_size=1, dp_rank=0)
    loader = DataLoader(Counting(), plan, skips=_windows((4, 2), batch=16))
    loader.resume_from(4, 64, counts_skips=True)
    assert [loader.start_of(t) for t in (4, 5)] == [96, 108]
    assert loader.consumed_before(5) == 108
    old = DataLoader(Counting(), plan, skips=_windows((4, 2)))
    old.resume_from(8, 8 * 16, counts_skips=False)  # written before windows were counted
    assert old.start_of(8) == 8 * 16 + 2 * 16


def test_launch_record_names_nodes_in_order_and_slurm(tmp_path):
    from mscale.topology.placement import load_checked_plan

    plan = load_checked_plan(small_plan(tmp_path))
    launch = {"argv": ["mscale", "train"], "cwd": "/w", "plan": "/w/p.yaml", "local": 4}
    rec = launch_record(launch, plan, env={})
    assert rec == {**launch, "nodes": ["node1", "node2"], "slurm": None,
                   "utc_offset_s": time.localtime().tm_gmtoff}
    rec = launch_record(launch, plan, env={"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j",
                                           "SLURM_JOB_NODELIST": "node[1-2]",
                                           "SLURM_JOB_NUM_NODES": "2"})
    assert rec["slurm"] == {"job_id": "42", "job_name": "j", "nodelist": "node[1-2]",
                            "nnodes": 2}


def test_launch_record_under_srun_names_the_steps_nodes_not_the_plans(tmp_path):
    """sbatch --exclude=node1 ran the plan's node[1-2] on node[2-3]: recording the plan's names
    blamed node1 for rank 0's error and re-checked node[1-2], outside the allocation."""
    from mscale.topology.placement import load_checked_plan

    plan = load_checked_plan(small_plan(tmp_path))
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[2-4]",
           "SLURM_STEP_NODELIST": "node[2-3]"}
    assert launch_record({}, plan, env=env, launcher="slurm")["nodes"] == ["node2", "node3"]
    assert launch_record({}, plan, env=env, launcher="local")["nodes"] == ["node1", "node2"]
    odd = {**env, "SLURM_STEP_NODELIST": "node[2-4]"}  # not the plan's node count: its names
    assert launch_record({}, plan, env=odd, launcher="slurm")["nodes"] == ["node1", "node2"]


def test_launch_of_is_absolute_and_runnable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["/x/mscale/cli/main.py", "train", "p.yaml"])
    rec = launch_of("p.yaml", 0)
    assert rec["plan"] == str(tmp_path / "p.yaml") and rec["cwd"] == str(tmp_path)
    assert rec["argv"][1:] == ["-m", "mscale.cli.main", "train", "p.yaml"] and rec["local"] == 0


def test_a_hook_rank_outside_the_job_is_refused_in_attempt_1_only(tmp_path):
    from mscale.train.launch import _check_hook_ranks

    opts = TrainOptions(run_dir=str(tmp_path / "run"), faults=FaultPlan(crash={5: 2}))
    with pytest.raises(MscaleError) as e:
        _check_hook_ranks(opts, 4)
    assert e.value.field == "--inject-crash" and "rank 5" in e.value.message
    _check_hook_ranks(TrainOptions(run_dir=opts.run_dir, faults=FaultPlan(crash={3: 2})), 4)
    (tmp_path / "run").mkdir()  # a relaunch on fewer ranks keeps the (disarmed) flags
    (tmp_path / "run" / "events.jsonl").write_text(json.dumps(
        {"source": "train", "kind": "start", "evidence": {"attempt": 1}}) + "\n")
    _check_hook_ranks(opts, 4)
