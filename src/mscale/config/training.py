"""How to train: batch, precision, optimizer, and the memory-saving choices.

Fields that the planner may choose (micro-batch, ZeRO stage, recompute) are optional here: leave
them out and `mscale plan` searches them; set them and the search is restricted to that value.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from mscale.config.base import FieldError, StrictModel

Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp32"]
Stack = Literal["mscale", "mscale-eager", "megascale", "megatron-lm", "megatron-core",
                "megatron-deepspeed", "llama3"]
"""Stack profile names (planner/stacks.py defines each; a test keeps the two lists equal)."""
ZeroStage = Annotated[int, Field(ge=0, le=2)]
"""0, 1 or 2 (an int, not a Literal: pydantic's Literal[0, 1, 2] would accept ``true`` as 1)."""

MAX_BATCH = 1 << 24
"""Largest global batch in sequences (16.7M; Llama 3 trained with a few thousand)."""
MAX_MICRO_BATCH = 1 << 16
"""Largest micro-batch in sequences."""
MAX_STEPS = 10**9
"""Most optimizer steps (and warm-up or checkpoint-interval steps) a run may ask for."""
DEFAULT_WARMUP = 10
"""Warm-up steps when the file gives none (a shorter run warms up over all its steps)."""


class DataSource(StrictModel):
    """One token source of a blend (docs/data.md)."""

    path: str = Field(min_length=1, max_length=4096)
    """A folder written by ``mscale data prepare``, a Megatron-LM prefix (``name`` for
    ``name.bin`` + ``name.idx``), a flat token file (nanoGPT's ``.bin``), or a glob of prefixes;
    a local path or an fsspec URL. A relative path is taken from the current directory (where
    ``mscale`` runs), not from the plan file's."""
    weight: float = Field(default=1.0, gt=0, le=1e6)
    """Share of the blend, relative to the other sources' weights (normalised)."""


TOKEN_FIELDS = ("path", "sources", "eval_sources", "eval_fraction", "dtype")
"""Fields of ``data`` that only real token data has."""


class DataConfig(StrictModel):
    """Where tokens come from, how they are mixed and shuffled, and what is held out."""

    kind: Literal["synthetic", "tokens"] = "synthetic"
    """``synthetic``: a seeded learnable stream (demos, tests); ``tokens``: real token data from
    ``path`` or ``sources``."""
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    """One source, the same as ``sources: [{path: ...}]`` (relative: from the current
    directory)."""
    sources: list[DataSource] = Field(default_factory=list, max_length=4096)
    """Several sources blended by weight."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a flat token file (prepared and Megatron datasets record their own)."""
    shuffle: bool = True
    """Sample order a seeded permutation of each source, new every epoch (False: file order)."""
    eval_fraction: float = Field(default=0.0, ge=0, le=0.5)
    """Held-out share of every source, cut at a document boundary at its end; its samples are
    never trained on. 0 with no ``eval_sources``: no held-out loss."""
    eval_sources: list[DataSource] = Field(default_factory=list, max_length=4096)
    """Held-out sources, instead of ``eval_fraction``."""
    read_ahead: int = Field(default=2, ge=0, le=64)
    """Steps of this rank's micro-batches read in a background thread ahead of the step, so a
    slow store does not stall it (0: read on demand)."""
    remote_retry_s: float = Field(default=7.5, ge=0, le=86400)
    """Seconds a remote read (an fsspec URL) may spend waiting between retries of a store that
    fails or does not answer (each try at most 60 s) before the job stops with exit 3: waits of
    0.5 s doubling to at most 30 s each, jittered. Raise it (e.g. 300) when the store's
    brown-outs outlast a few seconds: every rank that gives up stops the whole job."""

    @model_validator(mode="before")
    @classmethod
    def _kind_from_sources(cls, data):
        """Any field of real token data without ``kind`` means real tokens, even empty: a
        ``path:`` left blank by a template, ``sources: []`` or a held-out fraction alone must be
        an error naming the field, not a run on the synthetic stream that exits 0."""
        if isinstance(data, dict) and "kind" not in data and any(k in data for k in TOKEN_FIELDS):
            data = {**data, "kind": "tokens"}
        return data

    @model_validator(mode="after")
    def _path(self) -> "DataConfig":
        if self.kind == "tokens" and not (self.path or self.sources):
            raise FieldError("path", "real token data needs a path or sources: a dataset "
                             "prepared by `mscale data prepare`, a Megatron .bin/.idx prefix "
                             "or a flat uint16/uint32 token file (the synthetic stream takes "
                             f"none of {', '.join(TOKEN_FIELDS)}: leave them out)")
        if self.path and self.sources:
            raise FieldError("sources", "give either path (one source) or sources, not both")
        if self.kind == "synthetic" and (self.path or self.sources or self.eval_sources):
            raise FieldError("kind", "synthetic data reads no files: set kind: tokens")
        if self.eval_fraction and self.eval_sources:
            raise FieldError("eval_fraction", "give either eval_fraction or eval_sources")
        return self

    @property
    def train_sources(self) -> list[DataSource]:
        """``sources``, or the one ``path``."""
        return list(self.sources) or ([DataSource(path=self.path)] if self.path else [])

    @property
    def has_eval(self) -> bool:
        """Whether a held-out split exists (synthetic data always has one: another seed)."""
        return self.kind == "synthetic" or bool(self.eval_fraction or self.eval_sources)


class EvalConfig(StrictModel):
    """Held-out loss during training (docs/data.md, "Held-out (eval) loss")."""

    interval: int = Field(default=0, ge=0, le=MAX_STEPS)
    """Steps between evaluations, and one at the end; 0: never."""
    batches: int = Field(default=2, gt=0, le=4096)
    """Global batches of held-out data per evaluation: the same ones every time."""


class TrainingConfig(StrictModel):
    """Training settings, e.g. the ``training:`` section of a plan."""

    schema_version: int = Field(default=1, ge=1, le=1)
    """Version of this schema."""
    global_batch: int = Field(gt=0, le=MAX_BATCH)
    """Sequences per optimizer step, over all data-parallel replicas."""
    micro_batch: int | None = Field(default=None, gt=0, le=MAX_MICRO_BATCH)
    """Sequences per micro-batch per replica; at most ``global_batch``. None: the planner
    chooses. In a plan, ``layout.micro_batch`` trains and this must equal it."""
    precision: Precision = "bf16"
    """Compute precision: bf16 autocast with fp32 master weights, or plain fp32."""
    optimizer: Literal["adamw", "lamb"] = "adamw"
    """AdamW, or LAMB (layer-wise trust ratio; MegaScale §3.1: LAMB scaled its batch 4x without
    accuracy loss, docs/references.md)."""
    zero_stage: ZeroStage | None = None
    """0: replicated optimizer; 1: optimizer state sharded over DP; 2: gradients too. None: search.
    In a plan, ``layout.zero_stage`` trains and this must equal it."""
    recompute: Recompute | None = None
    """Activation recomputation. None: the planner chooses the cheapest that fits. In a plan,
    ``layout.recompute`` trains and this must equal it."""
    steps: int = Field(default=100, gt=0, le=MAX_STEPS)
    """Optimizer steps to run."""
    lr: float = Field(default=3e-4, gt=0, le=10)
    """Peak learning rate."""
    min_lr: float = Field(default=3e-5, ge=0, le=10)
    """Floor of the cosine decay; at most ``lr``."""
    warmup_steps: int = Field(default=DEFAULT_WARMUP, ge=0, le=MAX_STEPS)
    """Linear warm-up steps; at most ``steps``. Left out: 10, or ``steps`` when the run is
    shorter."""
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    """Shape after warm-up."""
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    """Decoupled weight decay (not applied to norms)."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam/LAMB first-moment decay."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Adam/LAMB second-moment decay."""
    eps: float = Field(default=1e-8, gt=0, le=1)
    """Adam/LAMB epsilon."""
    grad_clip: float = Field(default=1.0, gt=0, le=1e6)
    """Gradient-norm clipping threshold (the ceiling when adaptive clipping is on)."""
    adaptive_clip: bool = True
    """Clip at a multiple of the recent gradient-norm average instead of a fixed value (docs/train.md)."""
    seed: int = Field(default=1234, ge=0, lt=2**32)
    """Seed for initialisation and synthetic data; the same seed gives the same run at any layout."""
    bucket_mb: float = Field(default=25.0, gt=0, le=65536)
    """Gradient bucket size for overlapped data-parallel reduction, in MB."""
    overlap_grad_reduce: bool = True
    """Start each bucket's reduction during backward as soon as its gradients are ready."""
    data: DataConfig = DataConfig()
    """Token sources, blend, shuffle and held-out split."""
    eval: EvalConfig = EvalConfig()
    """Held-out loss during training."""
    tensorboard: bool = True
    """Write loss, eval loss, grad norm, lr, throughput, MFU and step times as TensorBoard
    scalars under RUN/tensorboard (rank 0)."""
    checkpoint_interval: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Steps between checkpoints. None: the plan's recommendation."""
    compile: bool | None = None
    """``torch.compile`` each block's attention, MLP and norms (one compiled graph per region,
    reused by every layer; the tensor-parallel collectives stay between them, uncompiled): fused
    norms, activations and rotary, fewer kernel launches. None: on with CUDA devices, off on
    CPUs (there the first step spends ~18 s building C++ and the steps gain little or lose;
    docs/benchmarks.md, "compiled blocks")."""
    stack: Stack | None = None
    """Training software whose overlaps and kernels the planner prices (docs/plan.md, "Stack
    profiles"): ``mscale`` (this engine; the default; priced as ``mscale-eager`` when
    ``compile`` is false), ``megascale``, ``megatron-lm`` (as in the 2021-22 papers),
    ``megatron-core`` (current defaults), ``megatron-deepspeed``, ``llama3``."""

    @model_validator(mode="after")
    def _consistent(self) -> "TrainingConfig":
        if self.min_lr > self.lr:
            lr = f"{self.lr:g}" + ("" if "lr" in self.model_fields_set else
                                   ", the default: lr is not set")
            raise FieldError("min_lr", f"{self.min_lr:g} is above lr ({lr}): the decay "
                             "would go upwards", fix="set min_lr at most lr (often lr/10)")
        if self.warmup_steps > self.steps:
            if "warmup_steps" not in self.model_fields_set:  # the default, on a short run
                object.__setattr__(self, "warmup_steps", self.steps)
            else:
                raise FieldError("warmup_steps", f"{self.warmup_steps} is more than steps "
                                 f"({self.steps}): the learning rate would never reach lr, nor "
                                 "decay", fix="set warmup_steps at most steps (commonly 1-10% "
                                 "of them), or raise steps")
        if self.micro_batch is not None and self.micro_batch > self.global_batch:
            raise FieldError("micro_batch", f"{self.micro_batch} is larger than global_batch "
                             f"({self.global_batch})")
        if self.eval.interval and not self.data.has_eval:
            raise FieldError("eval.interval", "no held-out data to evaluate on: set "
                             "data.eval_fraction or data.eval_sources, or eval.interval: 0")
        return self
