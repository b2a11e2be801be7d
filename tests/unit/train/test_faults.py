"""Fault hooks, data skips and the launch record of `mscale train` (without starting a job)."""

from __future__ import annotations

import dataclasses
import errno
import json
import signal

import pytest
import torch

from mscale.ckpt.options import CkptOptions
from mscale.ckpt.writer import write_shard
from mscale.cli.train import _parse_steps, launch_of
from mscale.config.records import DataSkip, DataSkips
from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.train import faults
from mscale.train.data import BatchPlan, DataLoader
from mscale.train.options import TrainOptions
from mscale.train.session import launch_record, read_data_skips
from tests.e2e.train_run import small_plan


def armed_options(tmp_path) -> TrainOptions:
    return TrainOptions(run_dir=str(tmp_path), inject_delay={1: 0.5}, inject_data_delay={0: 0.1},
                        inject_nan_step=3, inject_crash={2: 4}, inject_hang={3: 5},
                        ckpt=CkptOptions(inject_enospc_step=2, inject_kill={1: 4},
                                         inject_hang={0: 6}))


def test_options_survive_the_launchers_json_with_integer_ranks(tmp_path):
    opts = armed_options(tmp_path)
    back = TrainOptions(**json.loads(json.dumps(dataclasses.asdict(opts))))
    assert back == opts
    assert back.inject_crash == {2: 4} and back.ckpt.inject_kill == {1: 4}


def test_disarmed_options_have_no_hook_left(tmp_path):
    opts = armed_options(tmp_path)
    assert faults.any_armed(opts)
    off = faults.disarmed(opts)
    assert not faults.any_armed(off)
    assert off.run_dir == opts.run_dir and off.ckpt.keep == opts.ckpt.keep
    assert opts.inject_crash == {2: 4}  # the original is untouched


def test_write_fault_of_a_rank_and_step():
    c = CkptOptions(inject_enospc_step=2, inject_kill={1: 4}, inject_hang={0: 6})
    assert c.write_fault(1, 4) == "kill" and c.write_fault(0, 6) == "hang"
    assert c.write_fault(3, 2) == "enospc" and c.write_fault(1, 2) == "enospc"
    assert c.write_fault(1, 6) is None and c.write_fault(0, 4) is None


def test_step_fault_fires_once_on_its_step_after_a_forward(monkeypatch):
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    model = torch.nn.Linear(2, 2)
    opts = TrainOptions(run_dir="x", inject_crash={0: 2}, inject_hang={1: 1})
    f = faults.install([model], 0, opts)
    for step in range(3):
        f.begin_step(step)
        for _ in range(2):  # two micro-batches
            model(torch.zeros(1, 2))
    assert sent == [signal.SIGKILL]
    hang = faults.install([torch.nn.Linear(2, 2)], 1, opts)
    assert hang.hang_step == 1 and hang.crash_step is None


def test_an_enospc_write_leaves_a_partial_shard_and_raises_oserror(tmp_path):
    from mscale.ckpt.snapshot import Snapshot

    class Item:
        key, box, flat = "t", [[0, 4096]], [0, 4096]

    data = torch.arange(4096, dtype=torch.float32).view(torch.uint8)  # 16 KiB: 4 chunks
    snap = Snapshot(items=[Item()], views=[data], seconds=0.0, nbytes=data.numel())
    with pytest.raises(OSError) as e:
        write_shard(str(tmp_path), 0, snap, "raw", 0, chunk_bytes=4096, fault="enospc")
    assert e.value.errno == errno.ENOSPC and "inject-ckpt-enospc" in str(e.value)
    shard = tmp_path / "rank-00000.bin"
    assert shard.exists() and shard.stat().st_size == 4096  # the first chunk, flushed


@pytest.mark.parametrize("value", ["x", "1", "1:0", "1:2.5", "a:3"])
def test_bad_rank_step_hooks_are_refused(value):
    with pytest.raises(MscaleError) as e:
        _parse_steps([value], "--inject-crash")
    assert e.value.field == "--inject-crash"


def test_rank_step_hooks_parse():
    assert _parse_steps(["1:3", "2:10"], "--inject-hang") == {1: 3, 2: 10}


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
    assert rec == {**launch, "nodes": ["node1", "node2"], "slurm": None}
    rec = launch_record(launch, plan, env={"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j",
                                           "SLURM_JOB_NODELIST": "node[1-2]",
                                           "SLURM_JOB_NUM_NODES": "2"})
    assert rec["slurm"] == {"job_id": "42", "job_name": "j", "nodelist": "node[1-2]",
                            "nnodes": 2}


def test_launch_of_is_absolute_and_runnable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["/x/mscale/cli/main.py", "train", "p.yaml"])
    rec = launch_of("p.yaml", 0)
    assert rec["plan"] == str(tmp_path / "p.yaml") and rec["cwd"] == str(tmp_path)
    assert rec["argv"][1:] == ["-m", "mscale.cli.main", "train", "p.yaml"] and rec["local"] == 0


def test_a_hook_rank_outside_the_job_is_refused_in_attempt_1_only(tmp_path):
    from mscale.train.launch import _check_hook_ranks

    opts = TrainOptions(run_dir=str(tmp_path / "run"), inject_crash={5: 2})
    with pytest.raises(MscaleError) as e:
        _check_hook_ranks(opts, 4)
    assert e.value.field == "--inject-crash" and "rank 5" in e.value.message
    _check_hook_ranks(TrainOptions(run_dir=opts.run_dir, inject_crash={3: 2}), 4)
    (tmp_path / "run").mkdir()  # a relaunch on fewer ranks keeps the (disarmed) flags
    (tmp_path / "run" / "events.jsonl").write_text(json.dumps(
        {"source": "train", "kind": "start", "evidence": {"attempt": 1}}) + "\n")
    _check_hook_ranks(opts, 4)


def test_disarm_replaces_the_frozen_pipeline_stage(tmp_path):
    """A relaunch of a pipeline run that keeps its --inject-* flags: the stage (a frozen
    dataclass that copied the hooks when built) is replaced, not assigned (it raised
    FrozenInstanceError on every rank)."""
    from types import SimpleNamespace

    from mscale.parallel.pipeline.runner import PipelineStage

    stage = PipelineStage(chunks=[], pp=2, vpp=1, pp_rank=0, micro_batches=2,
                          device=torch.device("cpu"), link=None, get_batch=None, no_sync=None,
                          autocast=None, nan_step=3, delay_s=0.5)
    engine = SimpleNamespace(options=armed_options(tmp_path), pipeline=stage,
                             faults=SimpleNamespace(crash_step=2, hang_step=2))
    faults.disarm(engine)
    assert engine.pipeline.nan_step is None and engine.pipeline.delay_s == 0.0
    assert engine.pipeline.pp == 2 and engine.faults.crash_step is None
    assert stage.nan_step == 3  # the old object is untouched
