"""Stack profiles: what the training software overlaps and which kernels it runs.

The same layout runs at different speeds on different stacks: MegaScale hides half the TP
communication inside its GEMMs, Megatron-LM of 2021-22 hid none and reduced gradients after
backward, this project's engine overlaps the DP reduction but not TP. A prediction is only like
for like when it prices the stack that ran (or will run). The training file's ``stack`` (or
``mscale plan --stack``) picks one; docs/plan.md tabulates them with their sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from mscale.errors import MscaleError


@dataclass(frozen=True)
class StackProfile:
    """What one training stack overlaps and how its kernels run."""

    name: str
    tp_overlap: float
    """Share of TP/SP all-gathers and reduce-scatters hidden behind GEMMs."""
    dp_overlap: bool
    """Gradient reduce-scatter during the last backward and (ZeRO) parameter all-gather during
    the next forward; False: both after backward, fully exposed."""
    pp_overlap: float
    """Share of an off-critical-path pipeline transfer hidden behind compute."""
    flash_attention: bool
    """Attention core as one fused kernel (no s×s scores in memory); False: batched GEMMs plus a
    memory-bound softmax and dropout on the scores."""
    fused_norms: bool
    """Norms as single-pass fused kernels (element-wise bandwidth) rather than eager ops."""
    doc: str
    """Where each value comes from."""
    zero_stages: tuple[int, ...] = (0, 1, 2)
    """ZeRO stages the stack offers; the search tries only these (unless the training file
    names one)."""
    hierarchical_dp: bool = True
    """Whether the stack can reduce gradients hierarchically (inside the node, then across)."""
    this_engine: bool = False
    """Memory priced as this project's engine allocates (planner/memory.py); other stacks use
    Megatron's accounting."""


STACKS: dict[str, StackProfile] = {
    "megascale": StackProfile(
        "megascale", tp_overlap=0.5, dp_overlap=True, pp_overlap=0.9, flash_attention=True,
        fused_norms=True, hierarchical_dp=False,
        doc="MegaScale (arXiv 2402.15627) §3.2: TP all-gather/reduce-scatter fused with the "
            "adjacent GEMMs (half hidden: +2.2 MFU points in its Table 3; TP_OVERLAP), DP "
            "reduce-scatter/all-gather overlapped with the last backward / first forward, "
            "decoupled pipeline send/recv; §3.3 FlashAttention-2 and fused LayerNorm/GeLU. "
            "What the planner assumed before stack profiles existed."),
    "megatron-lm": StackProfile(
        "megatron-lm", tp_overlap=0.0, dp_overlap=False, pp_overlap=0.0, flash_attention=False,
        fused_norms=True, zero_stages=(0,), hierarchical_dp=False,
        doc="Megatron-LM as measured by Narayanan et al. 2021 (arXiv 2104.04473) and Korthikanti "
            "et al. 2022 (arXiv 2205.05198): TP collectives synchronous, the DP all-reduce after "
            "backward (no distributed optimizer or grad-reduce overlap then), blocking p2p, "
            "attention as batched GEMMs with a fused scale-mask-softmax (no flash kernel), fused "
            "LayerNorm and bias-GeLU (apex)."),
    "megatron-deepspeed": StackProfile(
        "megatron-deepspeed", tp_overlap=0.0, dp_overlap=False, pp_overlap=0.0,
        flash_attention=False, fused_norms=True, zero_stages=(0, 1), hierarchical_dp=False,
        doc="Megatron-DeepSpeed as used for MT-NLG (arXiv 2201.11990) and BLOOM (arXiv "
            "2211.05100), 2021-22: Megatron's kernels and synchronous TP, DeepSpeed's pipeline "
            "engine (blocking p2p) and data parallelism reducing after backward; no flash "
            "attention then. Priced like megatron-lm."),
    "megatron-core": StackProfile(
        "megatron-core", tp_overlap=0.0, dp_overlap=True, pp_overlap=0.9, flash_attention=True,
        fused_norms=True, zero_stages=(0, 1), hierarchical_dp=False,
        doc="Current Megatron-LM/Megatron-Core defaults: --overlap-grad-reduce and "
            "--overlap-param-gather with the distributed optimizer, --overlap-p2p-comm for the "
            "interleaved schedule, flash attention through Transformer Engine; TP communication "
            "overlap (--tp-comm-overlap) is off by default."),
    "llama3": StackProfile(
        "llama3", tp_overlap=0.0, dp_overlap=True, pp_overlap=0.9, flash_attention=True,
        fused_norms=True, hierarchical_dp=False,
        doc="Llama 3 (arXiv 2407.21783) §3.3.2: FSDP-style sharded data parallelism overlapped "
            "with compute, asynchronous pipeline p2p, flash attention; no TP overlap is "
            "described, so none is assumed."),
    "mscale": StackProfile(
        "mscale", tp_overlap=0.0, dp_overlap=True, pp_overlap=0.9, flash_attention=True,
        fused_norms=True,
        doc="This project's engine as it runs on GPUs (src/mscale/parallel/README.md): TP/SP "
            "collectives are synchronous autograd functions (none hidden); each bucket's "
            "reduction starts during the last backward and the ZeRO parameter all-gather is "
            "prefetched per bucket by the next forward (overlap_param_gather); pipeline "
            "sends/receives are batched isend/irecv posted ahead of compute (p2p.py); attention "
            "through torch SDPA (a flash kernel on GPUs); each block's norms, SwiGLU and rotary "
            "compiled by torch.compile (training.compile, on by default with CUDA), so norms run "
            "as fused single-pass kernels.",
        this_engine=True),
    "mscale-eager": StackProfile(
        "mscale-eager", tp_overlap=0.0, dp_overlap=True, pp_overlap=0.9, flash_attention=True,
        fused_norms=False,
        doc="This engine with ``training.compile: false``: as ``mscale``, but RMSNorm and "
            "SwiGLU run as eager torch ops (the measured unfused rates). The planner prices a "
            "training file that turns compilation off with this profile.",
        this_engine=True),
}
DEFAULT_STACK = "mscale"
"""A training file describes a run of this engine unless it says otherwise."""


def stack_profile(name: str | None, compiled: bool | None = None) -> StackProfile:
    """The profile called ``name`` (None: DEFAULT_STACK); MscaleError naming the choices.

    ``compiled`` is the training file's ``compile``: False turns this engine's default profile
    into ``mscale-eager``, because the engine then runs its norms unfused. Other stacks are
    priced as their sources describe them, whatever the switch says."""
    key = DEFAULT_STACK if name is None else name
    if key not in STACKS:
        raise MscaleError(f"unknown stack {name!r}", field="training.stack",
                          fix=f"use one of: {', '.join(STACKS)}")
    if key == "mscale" and compiled is False:
        key = "mscale-eager"
    return STACKS[key]
