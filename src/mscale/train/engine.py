"""Build everything one training process needs from a plan: groups, model, optimizer, data.

`build_engine` is the only place that knows how the pieces fit; the loop (loop.py) only calls
the engine's step functions, so a newcomer reads this file to see the whole wiring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mscale.ckpt.live import LiveRank
from mscale.config.plan import Plan
from mscale.config.records import DataSkips
from mscale.distributed.groups import ParallelGroups, build_groups
from mscale.distributed.init import init_distributed, pick_device
from mscale.parallel.data import GradBuffer, data_parallel
from mscale.parallel.param_gather import ParamGather
from mscale.parallel.precision import Precision
from mscale.parallel.shard_layout import bucket_bytes
from mscale.parallel.spec import ParamTable
from mscale.parallel.zero import DistributedOptimizer
from mscale.topology.env import LaunchEnv, check_node_matches
from mscale.topology.placement import placement_for
from mscale.parallel.pipeline.runner import PipelineStage, build_stage
from mscale.train.clip import AdaptiveClipper
from mscale.train.data import BatchPlan, DataLoader, make_sources
from mscale.train.faults import FaultHooks, install as install_faults
from mscale.train.options import TrainOptions


@dataclass
class Engine:
    """The live objects of one training process."""

    plan: Plan
    options: TrainOptions
    env: LaunchEnv
    groups: ParallelGroups
    device: torch.device
    chunks: list[torch.nn.Module]
    """Model chunks this rank runs: one, or vpp of them under interleaved pipelining."""
    params: list[torch.nn.Parameter]
    table: ParamTable
    """What each of ``params`` is in the global model (built by the parallelize step)."""
    grads: GradBuffer
    """The data-parallel gradient buffer (parallel/data.py)."""
    param_buffer: ParamGather
    """The parameters' flat storage and the ZeRO all-gathers that refill it
    (parallel/param_gather.py)."""
    optimizer: DistributedOptimizer
    """The distributed optimizer (ZeRO; parallel/zero.py)."""
    clipper: AdaptiveClipper
    loader: DataLoader
    get_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(tokens, labels) of (step, micro-batch): the loader's reader, or the fault injection's
    slow version of it (train/faults.py)."""
    faults: FaultHooks
    """This rank's test hooks, installed at build time (train/faults.py); the loop tells them
    the step."""
    precision: Precision
    """bf16 autocast and the step-long weight-cast scope (or no-ops under fp32)."""
    pipeline: PipelineStage | None
    """What the pipeline runner needs of this rank (pp > 1), built once with its link."""
    eval_loader: DataLoader | None = None
    """Held-out batches (`train.evaluate`), when the training file asks for an eval loss."""
    timings: dict[str, float] = field(default_factory=dict)
    """Start-up phases in seconds (process-group init, group build, model build)."""
    compiled: bool = False
    """The blocks run compiled (``training.compile``): the first step builds their kernels."""

    @property
    def micro_batches(self) -> int:
        return self.plan.layout.micro_batches(self.plan.training.global_batch)

    def live_rank(self) -> LiveRank:
        """What checkpoints save from and restore into (ckpt/live.py), and nothing more."""
        return LiveRank(plan=self.plan, groups=self.groups, device=self.device, params=self.params,
                        table=self.table, optimizer=self.optimizer, clipper=self.clipper,
                        timeout_s=self.options.timeout_s)


def build_engine(plan: Plan, env: LaunchEnv, options: TrainOptions, *, attempt: int = 1,
                 skips: DataSkips | None = None) -> Engine:
    """The engine of this rank, complete. ``attempt`` and ``skips`` are what rank 0 read from
    the run directory under its lock (train/loop.py): the test hooks act in attempt 1 only, and
    the loader passes over the recorded data windows."""
    from mscale.parallel.compile import compile_blocks, wants_compile
    from mscale.parallel.parallelize import build_chunks
    from mscale.parallel.tensor import TensorParallel

    timings = {}
    check_node_matches(plan, env)
    t0 = time.perf_counter()
    timeout = init_distributed(env, options.timeout_s)
    timings["init_process_group_s"] = time.perf_counter() - t0
    layout, training = plan.layout, plan.training
    groups = build_groups(placement_for(plan), env.rank, timeout,
                          hierarchical_dp=layout.dp_reduce == "hierarchical")
    timings["build_groups_s"] = groups.build_seconds
    device = pick_device(env)
    torch.manual_seed(training.seed)

    t0 = time.perf_counter()
    tp = TensorParallel.from_groups(groups, sequence_parallel=layout.sequence_parallel)
    chunks, table = build_chunks(plan, groups.pp_rank, tp, device, seed=training.seed)
    compiled = wants_compile(training.compile, device)
    if compiled:
        compile_blocks(chunks)  # compiles at the first forward; before the ZeRO hooks go on
    params = [p for c in chunks for p in c.parameters()]
    timings["build_model_s"] = time.perf_counter() - t0

    grads, param_buffer = data_parallel(params, table, groups, zero_stage=layout.zero_stage,
                                        bucket_bytes=bucket_bytes(training),
                                        overlap=training.overlap_grad_reduce,
                                        hierarchical=layout.dp_reduce == "hierarchical")
    optimizer = DistributedOptimizer(params, table, grads, param_buffer, training, groups)
    # a padded vocabulary (an HF import that TP does not divide): data uses only the real ids
    vocab = plan.model.real_vocab or plan.model.vocab
    source, held_out = make_sources(training.data, training.seed, plan.model.seq_len, vocab)
    batches = BatchPlan(training.global_batch, layout.micro_batch, groups.dp_size, groups.dp_rank)
    tp_read = dict(tp_group=groups.tp_group, tp_src=groups.tp_ranks[0], tp_size=groups.tp_size,
                   is_reader=groups.tp_rank == 0)
    loader = DataLoader(source, batches, read_ahead=training.data.read_ahead, skips=skips,
                        **tp_read)
    eval_loader = None
    if training.eval.interval and held_out is not None:
        eval_loader = DataLoader(held_out, batches, **tp_read)
    faults = install_faults(options.faults, env.rank, layout.micro_batches(training.global_batch),
                            chunks, attempt)
    get_batch = faults.wrap_get_batch(loader.get)
    param_buffer.attach_modules(chunks)  # ZeRO 1/2: a forward waits only for its own buckets
    precision = Precision.for_plan(plan, device)
    pipeline = None
    if layout.pp > 1:
        pipeline = build_stage(plan, groups, chunks, device=device, get_batch=get_batch,
                               grads=grads, precision=precision)
    return Engine(plan=plan, options=options, env=env, groups=groups, device=device,
                  chunks=chunks, params=params, table=table, grads=grads,
                  param_buffer=param_buffer, optimizer=optimizer,
                  clipper=AdaptiveClipper.from_config(training), loader=loader,
                  get_batch=get_batch, faults=faults, precision=precision, pipeline=pipeline,
                  eval_loader=eval_loader, timings=timings, compiled=compiled)
