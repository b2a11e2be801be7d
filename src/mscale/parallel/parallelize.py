"""The parallelize step: a plain `Transformer` in, the module one rank runs out, with its table.

`parallelize(model, tp, recompute)` swaps the plain model's layers for this rank's tensor-parallel
ones (`parallel/tensor.py`: column- and row-parallel linears, the vocabulary-parallel embedding),
marks where each block enters and exits the TP region (`TensorParallelBlock`), makes norm gains
sum their gradient over TP under sequence parallelism (`SequenceParallelNorm`), wraps what the
plan recomputes in backward, and builds the `ParamTable` that says what every parameter is in the
global model. The plain model's names are kept, so checkpoints and the table agree with
`transformers`' Llama and with every other layout. At tp = 1 the same modules run with every
collective skipped, so every layout takes one code path.

`build_chunks` does this for the chunks a pipeline rank holds: the plain model is built on the
meta device (no memory), parallelized there, and only the rank's shards are allocated on its
device and initialised (`init_parameters`: each shard's slice of `model.params.global_init`,
drawing only the tiles of it that the shard overlaps).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mscale.distributed.collectives import all_gather_into
from mscale.errors import MscaleError
from mscale.model.params import fill_init
from mscale.model.transformer import RMSNorm, Transformer, mask_padding, rms_norm
from mscale.parallel.pipeline.stages import rank_chunks
from mscale.parallel.spec import ParamSpec, ParamTable
from mscale.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallel,
                                    VocabParallelEmbedding, copy_to_tp, gather_from_sp,
                                    vocab_parallel_cross_entropy)

RECOMPUTE = ("none", "selective", "full")
COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up")
"""Block projections split by output rows: they read the entered (full-sequence) input."""
ROW = ("attn.wo", "mlp.down")
"""Block projections split by input columns: their partial outputs are summed on exit."""


class Recomputed(nn.Module):
    """Runs ``inner`` under activation checkpointing: its intermediates are dropped after forward
    and recomputed in backward (``recompute: selective`` wraps the attention core with this)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


class SequenceParallelNorm(RMSNorm):
    """RMSNorm under sequence parallelism: each TP rank normalises a different slice of the
    sequence, so each holds only part of the gain's gradient. Routing the gain through
    `copy_to_tp` all-reduces that gradient in backward, and every TP rank ends with the same
    complete gradient for the replicated gain."""

    normalize = staticmethod(rms_norm)
    """The norm itself; `parallel.compile.compile_blocks` swaps in a compiled one (the gain's
    all-reducing autograd function stays outside the graph)."""

    def __init__(self, plain: RMSNorm, tp: TensorParallel):
        nn.Module.__init__(self)  # not RMSNorm's: the gain is the plain norm's own parameter
        self.eps, self.tp, self.weight = plain.eps, tp, plain.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, copy_to_tp(self.weight, self.tp), self.eps)


class TensorParallelBlock(nn.Module):
    """`model.transformer.Block` with its TP region made explicit, and optionally recomputed.

    The forward is the plain block's with `TensorParallel.enter` (copy, or all-gather of sequence
    shards) before the column-parallel projections and `exit` (all-reduce, or reduce-scatter)
    after the row-parallel ones. In the parallel form attention and MLP share one enter and one
    exit: half the collectives. The submodules are the plain block's own (already swapped), under
    the same names.
    """

    def __init__(self, plain: nn.Module, tp: TensorParallel, recompute: str):
        super().__init__()
        self.parallel, self.tp, self.full_recompute = plain.parallel, tp, recompute == "full"
        _swap_projections(plain, tp)
        if recompute == "selective":  # drop the s×s-sized intermediates, keep the rest
            plain.attn.core = Recomputed(plain.attn.core)
        for name, child in plain.named_children():
            self.add_module(name, _norm(child, tp) if isinstance(child, RMSNorm) else child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.full_recompute:  # keep only the block's input; redo the block in backward
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if self.parallel:
            h = tp.enter(self.norm(x))
            return x + tp.exit(self.attn(h) + self.mlp(h))
        x = x + tp.exit(self.attn(tp.enter(self.attn_norm(x))))
        return x + tp.exit(self.mlp(tp.enter(self.mlp_norm(x))))


class TensorParallelTransformer(Transformer):
    """The plain `Transformer`'s forward over tensor-parallel parts; only the output differs:
    the head sees the full sequence (all-gathered under SP), computes this rank's vocabulary
    slice of the logits, and the loss is reduced over TP without gathering them."""

    def __init__(self, plain: Transformer, tp: TensorParallel, recompute: str):
        nn.Module.__init__(self)  # not Transformer's: every part comes from ``plain``
        self.cfg, self.has_embedding, self.has_head = plain.cfg, plain.has_embedding, plain.has_head
        self.layer_ids, self.tp = plain.layer_ids, tp
        if plain.has_embedding:
            self.embed = VocabParallelEmbedding(plain.embed, tp)
        self.layers = nn.ModuleDict({key: TensorParallelBlock(block, tp, recompute)
                                     for key, block in plain.layers.items()})
        if plain.has_head:
            self.final_norm = _norm(plain.final_norm, tp)
            if not plain.cfg.tie_embeddings:
                self.head = ColumnParallelLinear(plain.head, tp)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[s, b, V/tp]``: the full sequence on every TP rank, this rank's vocabulary slice."""
        tp = self.tp
        h = gather_from_sp(h, tp) if tp.sp else copy_to_tp(h, tp)
        logits = torch.nn.functional.linear(h, self.output_weight())
        return mask_padding(logits, self.cfg.real_vocab, first_id=tp.rank * logits.shape[-1])

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.tp)


def parallelize(model: Transformer, tp: TensorParallel,
                recompute: str = "none") -> tuple[TensorParallelTransformer, ParamTable]:
    """The module TP rank ``tp.rank`` runs for the plain ``model``, and the table of its
    parameters. ``model`` is consumed: its norms, attention cores and MLPs move into the result,
    their linear layers swapped for this rank's shards."""
    check_tp(model.cfg, tp, recompute)
    out = TensorParallelTransformer(model, tp, recompute)
    return out, param_table(out, tp)


def _swap_projections(block: nn.Module, tp: TensorParallel) -> None:
    """Replace the plain block's projections by this rank's column/row-parallel shards."""
    for path in COLUMN + ROW:
        parent, _, name = path.rpartition(".")
        owner = block.get_submodule(parent)
        if hasattr(owner, name):
            layer = ColumnParallelLinear if path in COLUMN else RowParallelLinear
            setattr(owner, name, layer(getattr(owner, name), tp))


def _norm(norm: RMSNorm, tp: TensorParallel) -> RMSNorm:
    return SequenceParallelNorm(norm, tp) if tp.sp else norm


def param_table(model: nn.Module, tp: TensorParallel) -> ParamTable:
    """One spec per parameter of a parallelized ``model``, in `parameters()` order: the global
    name and shape, the dimension split over TP, and whether weight decay applies."""
    by_id = {}
    for prefix, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            if isinstance(module, RMSNorm):
                spec = ParamSpec(name, tuple(p.shape), tp_dim=None, weight_decay=False)
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                     VocabParallelEmbedding)):
                spec = ParamSpec(name, module.global_shape, tp_dim=module.tp_dim)
            else:
                raise TypeError(f"parallelize does not know how to shard {name} "
                                f"({type(module).__name__})")
            by_id.setdefault(id(p), spec)
    return ParamTable(tuple(by_id[id(p)] for p in model.parameters()), tp.rank, tp.size)


def check_tp(cfg, tp: TensorParallel, recompute: str) -> None:
    """Refuse what this TP size cannot split, naming the plan field."""
    if recompute not in RECOMPUTE:
        raise MscaleError(f"recompute={recompute!r} is not one of {RECOMPUTE}",
                          field="training.recompute", fix="use none, selective or full")
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.num_kv_heads), ("ffn", cfg.ffn),
                    ("vocab", cfg.vocab)):
        if n % tp.size:
            raise MscaleError(f"tp={tp.size} does not divide {what}={n}", field="layout.tp",
                              fix=f"choose tp dividing {what}")


@torch.no_grad()
def init_parameters(params: list[torch.Tensor], table: ParamTable, seed: int,
                    num_layers: int) -> None:
    """Set every parameter to its TP slice of `global_init` (seed, global name): the values a
    single process would hold. Only the tiles of the global tensor that the slice overlaps are
    drawn (`fill_init`), one at a time, and copied into the parameter on its device."""
    for p, spec in zip(params, table, strict=True):
        fill_init(p, spec.name, spec.global_shape, table.local_slice(spec), seed, num_layers,
                  gain=not spec.weight_decay)


@contextlib.contextmanager
def _without_default_init():
    """The layers' own default initialisers as no-ops, while the plain model is built on the
    meta device: the values would be thrown away (`init_parameters` sets every parameter), and
    nn.Embedding's default ``normal_`` on meta runs through a ``torch._refs`` function that
    imports ``torch._dynamo`` on its first call, 1.6 s of CPU in every rank's start
    (docs/benchmarks.md, "a --local job's start"). transformers builds its models on meta the
    same way (``no_init_weights``)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to_empty(device=device)`` without its ``torch.empty_like``: on a meta tensor that
    runs a ``torch._refs`` function whose first call imports sympy and torch's symbolic shapes,
    1.4-1.7 s in every rank's start (docs/benchmarks.md, "a --local job's start"). Every
    tensor here is contiguous, so a plain ``torch.empty`` of its shape is the same layout."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build_chunks(plan, pp_rank: int, tp: TensorParallel, device: torch.device,
                 seed: int | None = None) -> tuple[list[TensorParallelTransformer], ParamTable]:
    """The chunks of pipeline rank ``pp_rank`` (the whole model without pipelining) and their
    table. Only this rank's shards are allocated, on ``device``; with ``seed`` they are set to
    `init_parameters`' values, else left uninitialised (to be loaded; on meta: shapes only)."""
    chunks, table = [], ParamTable((), tp.rank, tp.size)
    for spec in rank_chunks(plan, pp_rank):
        with torch.device("meta"), _without_default_init():
            plain = Transformer(plan.model, layer_ids=list(spec.layer_ids),
                                has_embedding=spec.has_embedding, has_head=spec.has_head)
        chunk, chunk_table = parallelize(plain, tp, plan.layout.recompute)
        chunks.append(_materialize(chunk, device))
        table = table + chunk_table
    if seed is not None:
        init_parameters([p for c in chunks for p in c.parameters()], table, seed,
                        plan.model.layers)
    return chunks, table


def gather_tp(t: torch.Tensor, spec: ParamSpec, tp: TensorParallel) -> torch.Tensor:
    """This rank's shard ``t`` → the full global tensor (a collective over the TP group)."""
    if spec.tp_dim is None or tp.size == 1:
        return t.detach().clone()
    moved = t.detach().movedim(spec.tp_dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * tp.size, *moved.shape[1:]))
    all_gather_into(out, moved, tp.group)
    return out.movedim(0, spec.tp_dim).contiguous()


def full_state_dict(modules: list[nn.Module], table: ParamTable, tp: TensorParallel, *,
                    grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or, with ``grads``, its gradient; zeros if none) as a full global tensor
    keyed by global name, on every TP rank; ``modules``: the chunks ``table`` describes. For
    tests: the training checkpoint is sharded and never gathers."""
    out = {}
    params = [p for m in modules for p in m.parameters()]
    for p, spec in zip(params, table, strict=True):
        t = p if not grads else (p.grad if p.grad is not None else torch.zeros_like(p))
        out[spec.name] = gather_tp(t, spec, tp)
    return out
