"""Measure the real engine's peak memory per rank and the planner's figure for the same layout.

CPU: `LiveBytes`, a dispatch mode that counts every tensor storage an operator creates for as
long as it lives (weak references; a free on any thread is seen), from before the engine is
built; its maximum during the training steps is the peak. Not `torch.profiler`'s memory events
(``profile_memory=True``): they are recorded per thread, so the frees of asynchronous gloo
collectives' buffers are missing and the running sum drifts up step after step. Not the
process's RSS either: it counts the interpreter, torch's libraries, gloo's buffers and pages
glibc keeps after a free, and never shrinks. GPU: ``torch.cuda.max_memory_allocated``
(bench/gpu_memory_check.py)."""

from __future__ import annotations

import numpy as np
import torch

MODEL = dict(name="m", layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=512, vocab=1024,
             seq_len=128)
"""Big enough that its buffers, not allocator noise and small tensors, make the peak."""
TRAINING = dict(global_batch=8, precision="bf16", bucket_mb=1.0, steps=2)


def case_of(layout: dict, model: dict | None = None, training: dict | None = None) -> dict:
    """A tests.distributed.engine_cases case for this model."""
    return {**layout, "model": {**MODEL, **(model or {})},
            "training": {**TRAINING, **(training or {})}}


def planned(case: dict, gpu: str | None = None) -> dict:
    """The planner's bytes for the case's layout: total and parts at the fullest rank.
    ``gpu``: price it for that GPU preset's kernels instead of the case's CPU cluster."""
    from mscale.config import ClusterConfig
    from mscale.planner.cost import Problem, layout_arrays
    from mscale.planner.memory import rank_memory
    from tests.distributed.engine_cases import make_plan

    plan = make_plan(case)
    cluster = plan.cluster
    if gpu is not None:
        cluster = ClusterConfig(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, gpu=gpu)
    pb = Problem(plan.model, plan.training, cluster)
    c = layout_arrays([plan.layout], plan.model.layers)
    micro = plan.layout.micro_batches(plan.training.global_batch)
    return {k: float(np.asarray(v).reshape(-1)[0])
            for k, v in rank_memory(pb, c, micro).items() if k != "fits"}


class LiveBytes:
    """A dispatch mode that counts the bytes of every tensor storage an operator creates, as long
    as that storage lives: each new storage gets a weak reference, and references that have
    expired (freed, from any thread) are dropped from the sum before the next operator is
    counted. ``peak`` is the most bytes live after any operator since `reset_peak`.

    Not the profiler's memory events: those are recorded per thread, so a tensor freed by a gloo
    worker thread (the buffers of an asynchronous collective) never shows its free there, and
    the running sum grows step after step (measured: +14 MB over two steps under SP)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = _matmul_in_fp32(func, args, kwargs or {})
                tracker.seen(out)
                return out

        self.mode = Mode()
        self.refs: dict[int, tuple] = {}
        self.live = 0
        self.peak = 0

    def seen(self, out) -> None:
        """Count ``out``'s new storages. ``live`` is exact after `drop_freed` and an upper bound
        between calls of it (frees only lower it), so the scan of every reference for frees,
        most of this mode's cost, runs only when the bound passes the peak: the peak is the
        same as with a scan after every operator (the world-1 cases took 45 s with one)."""
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.refs and self.refs[key][0].expired():  # address reused
                    self.live -= self.refs.pop(key)[1]
                if key and key not in self.refs:
                    self.refs[key] = (StorageWeakRef(st), st.nbytes())
                    self.live += st.nbytes()
        if self.live > self.peak:
            self.drop_freed()
            self.peak = max(self.peak, self.live)

    def drop_freed(self) -> None:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            self.live -= self.refs.pop(key)[1]

    def reset_peak(self) -> None:
        self.drop_freed()
        self.peak = self.live


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _matmul_in_fp32(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``; a bf16 matrix product computed in fp32 and rounded to bf16.

    Why: on a CPU without bf16 instructions (AVX2 only, as the two-core CI machine) oneDNN's
    bf16 ``mm`` runs at 3-50 ms for a 256×256×512 product against 1 ms in fp32, 90% of a bf16
    step (12× the fp32 step). The peak counted here is unchanged: the product is a new bf16
    tensor of the same shape either way, and the fp32 temporaries are made inside this
    handler, where the mode is off, as a kernel's workspace is (counted by neither). Only the
    values differ, by bf16 rounding, and they are not what this module measures."""
    if func in _MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
                                for a in args):
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return func(*wide, **kwargs).to(torch.bfloat16)
    return func(*args, **kwargs)


def measure(rank: int, world: int, case: dict, steps: int = 2) -> dict:
    """Build the engine with every operator's outputs counted (`LiveBytes`), run ``steps``
    optimizer steps; the peak of live bytes from the first step's start (the engine's
    construction is not training's peak; what it leaves live is counted)."""
    from mscale.train.loop import train_step
    from mscale.train.timers import StepTimer
    from tests.distributed.engine_cases import build_case_engine

    live = LiveBytes()
    with live.mode:
        engine = build_case_engine(rank, world, case)
        timer = StepTimer()
        live.reset_peak()
        start = live.live
        for step in range(steps):
            timer.start_step()
            train_step(engine, step, timer)
            timer.end_step()
        engine.param_buffer.wait()
        live.drop_freed()
    engine.grads.close()
    return {"peak": live.peak, "at_start": start, "at_end": live.live}
