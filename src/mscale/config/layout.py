"""A parallel layout: how one model is cut over the GPUs, and the checks that make it valid.

The same `check_layout` runs in `plan` (when evaluating a given layout), in `train` (refusing a plan
that cannot work) and in tests, so every command rejects a bad layout with the same message.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mscale.config.base import StrictModel
from mscale.config.cluster import ClusterConfig
from mscale.config.model import ModelConfig
from mscale.config.training import MAX_MICRO_BATCH, Recompute, TrainingConfig, ZeroStage
from mscale.errors import MscaleError

MAX_PARALLEL = 1 << 20
"""Largest tp, pp, dp or vpp: no cluster mscale plans for has more GPUs (cluster.MAX_GPUS)."""


class LayoutConfig(StrictModel):
    """The ``layout:`` section of a plan: parallel sizes and per-layout memory choices."""

    tp: int = Field(default=1, gt=0, le=MAX_PARALLEL)
    """Tensor-parallel size; lives inside one fast domain (node)."""
    pp: int = Field(default=1, gt=0, le=MAX_PARALLEL)
    """Pipeline-parallel stages."""
    dp: int = Field(default=1, gt=0, le=MAX_PARALLEL)
    """Data-parallel replicas; tp·pp·dp is the world size."""
    vpp: int = Field(default=1, gt=0, le=MAX_PARALLEL)
    """Virtual pipeline stages (model chunks) per rank; >1 selects interleaved 1F1B."""
    sequence_parallel: bool = False
    """Shard norms and activations between TP regions along the sequence (Korthikanti et al.)."""
    micro_batch: int = Field(default=1, gt=0, le=MAX_MICRO_BATCH)
    """Sequences per micro-batch per replica."""
    zero_stage: ZeroStage = 1
    """Optimizer-state (1) and gradient (2) sharding over the DP group."""
    recompute: Recompute = "none"
    """Activation recomputation."""
    dp_reduce: Literal["flat", "hierarchical"] = "flat"
    """DP gradient reduction: one ring over the group, or reduce-scatter inside the node, reduce
    across nodes on the shard, all-gather inside the node."""
    stage_layers: list[int] | None = Field(default=None, min_length=1, max_length=MAX_PARALLEL)
    """Transformer blocks per (virtual) stage, pp·vpp entries in pipeline order. Default: as even
    as possible, the remainder going to the middle stages (the first and last carry the embedding
    and the head). The first and last may be 0: a virtual stage holding only the embedding, or
    only the final norm, head and loss (Llama 3's balanced interleaving; docs/plan.md)."""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per replica per step (gradient-accumulation steps)."""
        return global_batch // (self.dp * self.micro_batch)

    def layers_per_stage(self, layers: int) -> list[int]:
        """The resolved split of ``layers`` blocks over pp·vpp virtual stages."""
        if self.stage_layers is not None:
            return list(self.stage_layers)
        return even_split(layers, self.pp * self.vpp)


def split_problem(split: list[int], layers: int) -> str | None:
    """What is wrong with a stage split of ``layers`` blocks, or None.

    Every stage between the first and the last needs a block: an empty one would only pass
    tensors on. The first and last virtual stages may be empty because they still carry the
    embedding, and the final norm, head and loss (a block's worth of work with a large
    vocabulary; Llama 3 §3.3.2 balances its pipeline this way)."""
    if sum(split) != layers:
        return f"counts {_brief(split)} sum to {sum(split)}, not the model's {layers} layers"
    if min(split) < 0:
        return f"counts {_brief(split)} include a negative count"
    empty = [i for i, n in enumerate(split) if n == 0 and 0 < i < len(split) - 1]
    if empty:
        return (f"middle stage {empty[0]} of {len(split)} has no blocks (only the first and "
                "last, which carry the embedding and the head, may be empty)")
    return None


def _brief(split: list[int]) -> str:
    return str(split) if len(split) <= 12 else f"[{', '.join(map(str, split[:12]))}, ...]"


def even_split(layers: int, stages: int) -> list[int]:
    """Split blocks over stages as evenly as possible; extra blocks go to the middle stages,
    since the first stage also runs the embedding and the last the head and loss.

    The extra blocks go to the middle stages nearest the centre (on a tie, the lower index
    first), and once every middle stage has one, to the first stage. Computed as a window
    around the centre rather than by sorting, so that the planner can call it for thousands of
    candidate splits of thousands of stages (tests/unit/config/test_schemas.py checks it
    against the sort it replaces)."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = max(stages - 2, 0)
    if stages <= 2:
        for i in range(extra):  # no middle stage: the first end, then the last
            counts[i] += 1
        return counts
    lo, take = centre_window(extra, stages)
    for i in range(lo, lo + take):
        counts[i] += 1
    if extra > middle:  # every middle stage has one; then the first end (extra < stages)
        counts[0] += 1
    return counts


def centre_window(extra: int, stages: int) -> tuple[int, int]:
    """(first stage, count) of the middle stages `even_split` gives an extra block: the
    ``min(extra, stages - 2)`` nearest the centre, the lower index first on a tie (an even count
    of stages has two central ones). The planner prices pipeline ranks from it without
    building the split (planner/cost.py `rank_layer_counts`)."""
    take = min(extra, max(stages - 2, 0))
    half = (take - 1) // 2 if stages % 2 == 0 else take // 2
    return (stages - 1) // 2 - half, take


def check_layout(layout: LayoutConfig, model: ModelConfig, training: TrainingConfig,
                 cluster: ClusterConfig | None, source: str | None = None) -> None:
    """Raise MscaleError naming the field and the fix if the layout cannot run this model."""

    def bad(field: str, message: str, fix: str) -> MscaleError:
        return MscaleError(message, file=source, field=f"layout.{field}", fix=fix)

    if model.heads % layout.tp:
        raise bad("tp", f"tp={layout.tp} does not divide heads={model.heads}",
                  "choose tp among the divisors of the head count")
    if model.num_kv_heads % layout.tp:
        raise bad("tp", f"tp={layout.tp} does not divide kv_heads={model.num_kv_heads}",
                  "choose tp dividing the key/value head count")
    if model.ffn % layout.tp:
        raise bad("tp", f"tp={layout.tp} must divide ffn ({model.ffn})",
                  "pad the MLP width (model.ffn_hidden) to a multiple of tp, or pick a smaller tp")
    if model.vocab % layout.tp:
        pad = -(-model.vocab // layout.tp) * layout.tp
        raise bad("tp", f"tp={layout.tp} must divide vocab ({model.vocab})",
                  f"pad the vocabulary: model.vocab: {pad} with model.real_vocab: "
                  f"{model.real_vocab or model.vocab} (the padded logits are masked out), or pick "
                  "a smaller tp")
    if model.tie_embeddings and layout.pp > 1:
        raise bad("pp", f"model.tie_embeddings with pp={layout.pp}: the embedding (first stage) "
                  "and the head (last stage) would share one weight across stages, which the "
                  "engine does not keep in step", "set pp: 1, or model.tie_embeddings: false "
                  "(the head gets weights of its own)")
    if layout.sequence_parallel and layout.tp > 1 and model.seq_len % layout.tp:
        raise bad("sequence_parallel", f"seq_len={model.seq_len} not divisible by tp={layout.tp}",
                  "use a sequence length divisible by tp, or turn sequence_parallel off")
    if layout.vpp > 1 and layout.pp == 1:
        raise bad("vpp", "virtual stages need pp > 1", "set vpp: 1 or pp >= 2")
    stages = layout.pp * layout.vpp
    if layout.stage_layers is None and stages > model.layers + 2:
        raise bad("pp", f"pp·vpp = {stages} stages but the model has {model.layers} layers",
                  "give every middle (virtual) stage at least one layer: lower pp or vpp")
    split = layout.layers_per_stage(model.layers)
    if len(split) != stages:
        raise bad("stage_layers", f"{len(split)} entries for pp·vpp={layout.pp * layout.vpp} stages",
                  "give one layer count per virtual stage, or drop stage_layers")
    problem = split_problem(split, model.layers)
    if problem:
        raise bad("stage_layers", problem, "give every middle stage >= 1 block (the first and "
                  "last may have 0) and make the counts sum to model.layers")
    per_replica = layout.dp * layout.micro_batch
    if training.global_batch % per_replica:
        raise bad("micro_batch", f"global_batch={training.global_batch} is not divisible by "
                  f"dp·micro_batch={per_replica}", "pick a global batch that is a multiple of dp·micro_batch")
    m = layout.micro_batches(training.global_batch)
    if layout.pp > 1 and m < layout.pp:
        raise bad("micro_batch", f"{m} micro-batches per step < pp={layout.pp} stages: 1F1B cannot "
                  "fill the pipeline", "raise global_batch or lower micro_batch so that "
                  "global_batch/(dp·micro_batch) >= pp")
    if layout.vpp > 1 and m % layout.pp:
        raise bad("vpp", f"interleaved 1F1B needs micro-batches ({m}) divisible by pp={layout.pp}",
                  "adjust global_batch or micro_batch")
    if cluster is None:
        return
    if layout.world_size != cluster.world_size:
        unset = [k for k in ("tp", "pp", "dp") if k not in layout.model_fields_set]
        raise bad("dp", f"tp·pp·dp = {layout.tp}·{layout.pp}·{layout.dp} = {layout.world_size} "
                  f"but the cluster has {cluster.world_size} GPUs"
                  + (f" ({', '.join(unset)} not set: 1)" if unset else ""),
                  "make tp·pp·dp equal nodes·gpus_per_node")
    if cluster.domain_size % layout.tp:
        raise bad("tp", f"tp={layout.tp} does not fit a fast domain of {cluster.domain_size} GPUs",
                  "tensor parallelism must stay inside one NVLink domain: pick a divisor of it")
