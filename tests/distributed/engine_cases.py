"""Drive the real training engine for K steps at a given layout, inside run_distributed.

Shared by the engine numerics tests (TP/SP/DP/ZeRO, pipeline): a case is a plain dict so it can be
pickled into the spawned processes; the result is the per-step losses and the full (TP-gathered)
parameters, which every layout must agree on with a single process.
"""

from __future__ import annotations

import torch

BASE_MODEL = dict(name="t", layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=256,
                  seq_len=32)
BASE_TRAINING = dict(global_batch=8, micro_batch=2, precision="fp32", optimizer="adamw",
                     steps=3, lr=1e-3, min_lr=1e-4, warmup_steps=0, seed=7, bucket_mb=0.02,
                     adaptive_clip=False, grad_clip=1.0)


def make_plan(case: dict):
    """A Plan from a case: keys tp, pp, dp, vpp, sp, zero, mb, gpn, hier, recompute,
    stage_layers, model (dict of ModelConfig overrides), training (dict of TrainingConfig
    overrides)."""
    from mscale.config.plan import Plan

    tp, pp, dp = case.get("tp", 1), case.get("pp", 1), case.get("dp", 1)
    world = tp * pp * dp
    gpn = case.get("gpn", max(tp, min(world, 2)))
    mb = case.get("mb", 2)
    return Plan.model_validate(dict(
        name="case",
        cluster=dict(nodes=max(1, world // gpn), gpus_per_node=gpn, gpu="cpu"),
        model={**BASE_MODEL, **case.get("model", {})},
        training={**BASE_TRAINING, "micro_batch": mb, **case.get("training", {})},
        layout=dict(tp=tp, pp=pp, dp=dp, vpp=case.get("vpp", 1), micro_batch=mb,
                    sequence_parallel=case.get("sp", False), zero_stage=case.get("zero", 1),
                    recompute=case.get("recompute", "none"),
                    dp_reduce="hierarchical" if case.get("hier") else "flat",
                    stage_layers=case.get("stage_layers"))))


def build_case_engine(rank: int, world: int, case: dict):
    """The real engine for ``case`` on this rank, as the training loop builds it."""
    from mscale.topology.env import LaunchEnv
    from mscale.train.engine import build_engine
    from mscale.train.options import TrainOptions

    plan = make_plan(case)
    gpn = plan.cluster.gpus_per_node
    env = LaunchEnv(rank=rank, world_size=world, local_rank=rank % gpn, local_world_size=gpn,
                    node_rank=rank // gpn, master_addr="127.0.0.1", master_port=0,
                    launcher="test", hostname="localhost")
    return build_engine(plan, env, TrainOptions(run_dir="memory://unused", timeout_s=60))


def run_case(rank: int, world: int, case: dict, steps: int) -> dict:
    """Build the engine for ``case`` on this rank and run ``steps`` optimizer steps."""
    from mscale.parallel.parallelize import full_state_dict
    from mscale.parallel.tensor import TensorParallel
    from mscale.train.loop import train_step
    from mscale.train.timers import StepTimer

    engine = build_case_engine(rank, world, case)
    plan = engine.plan
    timer = StepTimer()
    losses = []
    for step in range(steps):
        timer.start_step()
        losses.append(train_step(engine, step, timer).loss)
        timer.end_step()
    eval_loss = None
    if engine.eval_loader is not None:  # the held-out loss through the same layout
        from mscale.train.evaluate import evaluate

        eval_loss = evaluate(engine, engine.eval_loader, plan.training.eval.batches).loss
    tp = TensorParallel.from_groups(engine.groups, plan.layout.sequence_parallel)
    engine.param_buffer.wait()  # the last step's parameter all-gathers
    params = {k: v.detach().clone()
              for k, v in full_state_dict(engine.chunks, engine.table, tp).items()}
    engine.grads.close()
    engine.loader.close()
    return {"losses": losses, "params": params, "eval_loss": eval_loss,
            "coord": (engine.groups.dp_rank,
            engine.groups.pp_rank, engine.groups.tp_rank)}


def run_cases(rank: int, world: int, cases: list[dict], steps: int) -> list[dict]:
    """Several cases in one launch (process start-up dominates on these CPUs)."""
    return [run_case(rank, world, c, steps) for c in cases]


def merge_params(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full parameters, gathered over pipeline stages, after checking that every rank holding a
    copy agrees: TP ranks hold replicated tensors (norms) and DP replicas hold everything, and a
    rank whose copy drifted (a missed all-reduce of a replicated gradient) must fail the case
    rather than be hidden by whichever copy is read last."""
    out: dict[str, torch.Tensor] = {}
    holder: dict[str, tuple] = {}
    for r in results:
        for name, value in r["params"].items():
            if name not in out:
                out[name], holder[name] = value, r["coord"]
                continue
            assert torch.equal(out[name], value), (
                f"{name}: rank at (dp, pp, tp) {r['coord']} differs from {holder[name]} by "
                f"{(out[name] - value).abs().max().item():.3g}")
    return out


def reported_losses(results: list[dict]) -> list[float]:
    """Mean over DP replicas of the last stage's per-step losses (what metrics.jsonl reports)."""
    per_rank = [r["losses"] for r in results if r["losses"][0] is not None and r["coord"][2] == 0]
    return [sum(x) / len(per_rank) for x in zip(*per_rank)]
