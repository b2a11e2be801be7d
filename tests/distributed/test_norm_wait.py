"""The global gradient norm's all-reduce waits for every stage: that wait is communication of
the pipeline kind, not compute (parallel/zero.py, `_sum_over`). Uncounted, a slow DP link in
stage 1 made stage 0 look like it computed 0.5 s more a step, and watch advised a re-plan."""

from datetime import timedelta

import pytest

from tests.distributed.dp_model import SHAPES, config, make_params, make_table
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist
TIMEOUT = timedelta(seconds=60)
LATE_S = 0.5


def _norm_wait(rank, world):
    """pp 2: stage 1 reaches the norm ``LATE_S`` after stage 0; what stage 0's clock counted."""
    import time

    import torch.distributed as dist

    from mscale.distributed.collectives import COMM_CLOCK, HostClock
    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement

    groups = build_groups(Placement(tp=1, pp=2, dp=1, gpus_per_node=2), rank, TIMEOUT)
    names = [s[0] for s in SHAPES][:3] if groups.pp_rank == 0 else [s[0] for s in SHAPES][3:]
    params, table = make_params(0, names=names), make_table(names=names)
    grads, pbuf = data_parallel(params, table, groups, zero_stage=1, bucket_bytes=1 << 16)
    opt = DistributedOptimizer(params, table, grads, pbuf, config(), groups)
    for p in params:
        p.grad = p.detach().clone()
    grads.finish()
    dist.barrier()
    COMM_CLOCK.use(HostClock())
    if groups.pp_rank == 1:
        time.sleep(LATE_S)
    opt.grad_norm()
    total, kinds = COMM_CLOCK.take()
    grads.close()
    return groups.pp_rank, total, kinds


def test_the_norm_waiting_for_a_late_stage_is_pipeline_communication():
    for stage, total, kinds in run_distributed(_norm_wait, 2):
        if stage == 0:  # it waited for stage 1 in the norm's all-reduce
            assert kinds["pp"] >= 0.5 * LATE_S and total >= kinds["pp"], kinds
