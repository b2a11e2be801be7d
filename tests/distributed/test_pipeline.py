"""Pipeline parallelism through the real Engine matches a single process.

Every layout trains K steps of AdamW (fp32, lr 1e-3, norm clipping active at 1.0) from the same
seed and data as `reference_run` (one process, no pipelining); losses, gradient norms and every
parameter must agree. Tolerance: parameters within 1e-5 absolute + 1e-4 relative, loss and norm
within 1e-5 relative. Measured (float32 summation order only): parameters within 2e-7 without
TP (exact for pp=2, m=4), 2.1e-6 with TP=2 (AdamW amplifies differences in near-zero gradient
elements); loss and norm within 1.3e-7 relative.

Several layouts share one launch: the layouts of a launch use the first tp·pp·dp ranks, the
others sit the layout out (start-up costs ~2 s per 2 processes on these cores).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.pipeline_plan import clip_coef, reference_run, tiny_plan

pytestmark = pytest.mark.dist
STEPS = 3

# name → (tp, pp, dp, options)
LAYOUTS_8 = {
    "tp2-pp2-dp2-zero1": (2, 2, 2, {}),
    "tp2-pp2-dp2-zero2-sp": (2, 2, 2, dict(zero=2, sp=True)),
}
LAYOUTS_4 = {
    "pp4-m8-uneven": (1, 4, 1, dict(global_batch=16)),
    "pp2-dp2-vpp2-zero1": (1, 2, 2, dict(vpp=2)),
    # the first virtual stage holds only the embedding, the last only the norm, head and loss
    "pp2-dp2-vpp2-empty-ends": (1, 2, 2, dict(vpp=2, stage_layers=[0, 3, 3, 0])),
    "pp2-dp2-vpp2-zero2-m4": (1, 2, 2, dict(vpp=2, zero=2, global_batch=16)),
    "tp2-pp2-sp": (2, 2, 1, dict(sp=True)),
    "pp2-m4-zero2": (1, 2, 1, dict(zero=2)),
}


def _plan(spec):
    tp, pp, dp, opts = spec
    return tiny_plan(tp, pp, dp, **opts)


def _train(rank: int, plan, steps: int) -> dict:
    from mscale.parallel.parallelize import full_state_dict
    from mscale.topology.env import LaunchEnv
    from mscale.train.engine import build_engine
    from mscale.train.options import TrainOptions
    from mscale.train.step import forward_backward
    from mscale.train.timers import StepTimer

    world = plan.layout.world_size
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                    node_rank=0, master_addr="127.0.0.1", master_port=0, launcher="torchrun",
                    hostname="local")
    engine = build_engine(plan, env, TrainOptions(run_dir=tempfile.mkdtemp(), timeout_s=60))
    g, timer = engine.groups, StepTimer()
    out = {"losses": [], "norms": [], "timings": [], "overlapped": []}
    for step in range(steps):
        timer.start_step()
        out["losses"].append(forward_backward(engine, step, timer))
        timer.add("comm_wait", engine.grads.finish())
        out["overlapped"].append(engine.grads.overlapped_buckets)
        out["norms"].append(engine.optimizer.grad_norm())
        engine.optimizer.step(plan.training.lr, clip_coef(plan, out["norms"][-1]))
        out["timings"].append(timer.end_step())
    engine.param_buffer.wait()  # the last step's parameter all-gathers, as the loop does
    params = full_state_dict(engine.chunks, engine.table, engine.chunks[0].tp)
    engine.grads.close()
    out.update(pp_rank=g.pp_rank, dp_rank=g.dp_rank, tp_rank=g.tp_rank,
               last=g.is_last_stage, params=params if g.tp_rank == 0 and g.dp_rank == 0 else None)
    return out


def _train_layouts(rank: int, world: int, layouts: dict, steps: int) -> dict:
    results = {}
    for name, spec in layouts.items():
        plan = _plan(spec)
        if rank < plan.layout.world_size:
            results[name] = _train(rank, plan, steps)
    return results


def _check(name: str, plan, ranks: list[dict], ref: dict) -> None:
    live = [r[name] for r in ranks if name in r]
    losses = [r["losses"] for r in live if r["last"] and r["tp_rank"] == 0]
    assert len(losses) == plan.layout.dp
    for r in live:  # the loss exists on the last stage only (on each of its TP ranks)
        assert (r["losses"] == [None] * STEPS) != r["last"], name
    mean = [sum(x) / len(losses) for x in zip(*losses)]  # the engine's mean over DP replicas
    assert mean == pytest.approx(ref["losses"], rel=1e-5), name
    for r in live:  # one norm, the same on every stage, replica and TP rank
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
    params = {}
    for r in live:
        if r["params"] is not None:
            assert not params.keys() & r["params"].keys(), f"{name}: a parameter on two stages"
            params.update(r["params"])
    assert params.keys() == ref["params"].keys(), name
    for key, want in ref["params"].items():
        torch.testing.assert_close(params[key], want, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    if plan.layout.dp > 1:  # DP reduction started inside the last backwards, not after them
        assert all(n > 0 for r in live for n in r["overlapped"]), name
    assert all(t["bubble"] > 0 for r in live for t in r["timings"]), name


@pytest.mark.parametrize("world,layouts", [(8, LAYOUTS_8), (4, LAYOUTS_4)], ids=["8", "4"])
def test_pipeline_matches_single_process(world, layouts):
    ranks = run_distributed(_train_layouts, world, layouts, STEPS, timeout_s=90)
    for name, spec in layouts.items():
        plan = _plan(spec)
        _check(name, plan, ranks, reference_run(plan, STEPS))
