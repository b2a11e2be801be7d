"""Accelerator presets: dense BF16 peaks and memory, from docs/references.md.

The dense peak is what MFU divides by. The 1,979 TFLOP/s often quoted for H100/H800 assumes 2:4
sparsity, which dense training never uses, so it appears nowhere here.
"""

from __future__ import annotations

from pydantic import Field

from mscale.config.base import StrictModel

MAX_RATE = 100_000.0
"""Largest peak (TFLOP/s), memory (GB) or bandwidth (GB/s, Gb/s) accepted: ~50x today's parts."""


class GPUSpec(StrictModel):
    """What the cost model needs to know about one accelerator."""

    name: str = Field(min_length=1, max_length=200)
    """Marketing name, e.g. ``H100``."""
    peak_tflops: float = Field(gt=0, le=MAX_RATE)
    """Dense BF16 peak in TFLOP/s (no sparsity)."""
    memory_gb: float = Field(gt=0, le=MAX_RATE)
    """Device memory in GB (10^9 bytes) as sold."""
    nvlink_gb_per_s: float = Field(gt=0, le=MAX_RATE)
    """GPU-to-GPU bandwidth inside the fast domain, bidirectional GB/s as the vendor quotes it."""

    @property
    def is_cpu(self) -> bool:
        """The ``cpu`` preset, or a spec of one named ``cpu-...``: gloo processes, not GPUs."""
        return self.name.lower().startswith("cpu")


GPU_PRESETS: dict[str, GPUSpec] = {
    # docs/references.md, "Hardware peaks (dense, no sparsity)".
    "A100": GPUSpec(name="A100", peak_tflops=312, memory_gb=80, nvlink_gb_per_s=600),
    "A100-40GB": GPUSpec(name="A100-40GB", peak_tflops=312, memory_gb=40, nvlink_gb_per_s=600),
    "H100": GPUSpec(name="H100", peak_tflops=989, memory_gb=80, nvlink_gb_per_s=900),
    "H800": GPUSpec(name="H800", peak_tflops=989, memory_gb=80, nvlink_gb_per_s=400),
    "H200": GPUSpec(name="H200", peak_tflops=989, memory_gb=141, nvlink_gb_per_s=900),
    # A CPU "device" for gloo test runs: a nominal peak so that MFU is defined; "memory" is a
    # per-process budget, "nvlink" the loopback bandwidth measured here (docs/references.md). It exists so
    # that CPU plans validate and run; its time predictions mean nothing (several processes share
    # two cores, and per-collective latency, not bandwidth, dominates tiny models).
    "cpu": GPUSpec(name="cpu", peak_tflops=0.2, memory_gb=2, nvlink_gb_per_s=3),
}


def resolve_gpu(value: str | GPUSpec) -> GPUSpec:
    """Accept a preset name (case-insensitive) or a full spec."""
    if isinstance(value, GPUSpec):
        return value
    for key, spec in GPU_PRESETS.items():
        if key.lower() == value.lower():
            return spec
    raise ValueError(f"unknown GPU kind {value!r}; presets: {', '.join(GPU_PRESETS)}, "
                     "or give a mapping with name, peak_tflops, memory_gb, nvlink_gb_per_s")
