"""Turn a chosen layout and its cost into the plan.yaml that `preflight` and `train` read."""

from __future__ import annotations

from mscale.config.layout import LayoutConfig
from mscale.config.plan import LAYOUT_CHOICES, Plan
from mscale.config.training import TrainingConfig
from mscale.planner.cost import LayoutCost, Problem
from mscale.planner.goodput import GoodputInputs, advise
from mscale.topology.placement import placement_record


def estimate_record(pb: Problem, layout: LayoutConfig, cost: LayoutCost) -> dict:
    """The ``estimate:`` section: every cost term, rounded for reading, with units in the names."""
    gb = {f"{k[4:]}_gb": round(getattr(cost, k) / 1e9, 3)
          for k in ("mem_weights", "mem_gradients", "mem_optimizer", "mem_activations",
                    "mem_logits", "mem_weight_copies", "mem_total", "mem_budget")}
    gb["host_pinned_gb"] = round(cost.host_pinned / 1e9, 3)  # host memory, not in total_gb
    secs = {f"{k[2:]}_s": round(getattr(cost, k), 4)
            for k in ("t_model", "t_recompute", "t_imbalance", "t_bubble", "t_tp", "t_pp", "t_dp")}
    return {
        "schedule": layout.schedule,
        "micro_batches": cost.micro_batches,
        "parameters": pb.model.num_parameters(),
        "model_flops_per_step": pb.model_flops,
        "peak_tflops_per_gpu": pb.cluster.gpu.peak_tflops,
        "stack": pb.stack_profile.name,
        # the model's work at the kernels' modelled rates, as a share of peak
        "kernel_efficiency": round(cost.mfu * cost.step_time / cost.t_model, 4),
        "memory": gb,
        "time": secs,
        "step_time_s": round(cost.step_time, 4),
        "tokens_per_s": round(cost.tokens_per_s, 1),
        "mfu": round(cost.mfu, 4),
        "hfu": round(cost.hfu, 4),
        "lost": {k: round(v, 4) for k, v in cost.losses().items()},
    }


def make_plan(pb: Problem, layout: LayoutConfig, cost: LayoutCost, name: str,
              goodput: GoodputInputs = GoodputInputs()) -> Plan:
    """A complete Plan: configs, layout, placement, estimate and checkpoint advice."""
    advice, note = advise(pb.model.num_parameters(), pb.cluster.world_size, pb.cluster.num_nodes,
                          cost.step_time, goodput, run_steps=pb.training.steps)
    estimate = estimate_record(pb, layout, cost)
    estimate["checkpoint_interval_note"] = note
    plan = Plan(name=name, cluster=pb.cluster, model=pb.model,
                training=training_for(pb.training, layout), layout=layout, estimate=estimate,
                checkpoint=advice)
    plan.placement = placement_record(plan)
    return plan


def training_for(training: TrainingConfig, layout: LayoutConfig) -> TrainingConfig:
    """The training section written beside ``layout``: a micro-batch, ZeRO stage or recompute
    the training file restricted the search to is replaced by the layout's own when a layout
    given on the command line (`--keep-given`) chose another, so the plan says one value, the
    one it trains with (`train` refuses a plan whose two sections disagree)."""
    differ = {name: getattr(layout, name) for name in LAYOUT_CHOICES
              if getattr(training, name) not in (None, getattr(layout, name))}
    return training.model_copy(update=differ) if differ else training
