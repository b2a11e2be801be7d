"""Data parallelism: a flat fp32 gradient buffer in buckets, reduced while backward still runs.

Per step the training loop does::

    for i, mb in enumerate(micro_batches):
        with grads.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss(mb) / len(micro_batches)).backward()
    comm_wait = grads.finish()          # seconds blocked on DP communication (exposed)
    # then the optimizer (parallel/zero.py): grad_norm(), step(lr, clip_coef)

Gradients are *copied* into the buffer by a post-accumulate-grad hook, which then sets
``param.grad = None``, rather than making ``param.grad`` a view of the buffer. Why: the buffer is
fp32 whatever the parameters' dtype (a bf16 parameter cannot have an fp32 ``.grad`` view), the
per-parameter gradient is released as soon as it is copied (peak = buffer + one gradient), and
under ZeRO-2 a bucket's storage can be dropped after its reduction without leaving dangling
``.grad`` views. The cost is one add per gradient element per micro-batch, as Megatron's
``main_grad`` accumulation pays.

On the last micro-batch (outside `no_sync`) each bucket's reduction starts as soon as its last
gradient has arrived. Buckets are launched strictly in bucket order (a ready bucket waits for
earlier ones) so every rank issues the same collectives in the same order even if hooks fire in
a slightly different order. Reduction = mean over the DP group: each bucket is divided by the DP
size, then summed.

Memory, honestly:
- ZeRO 0: the full buffer persists; all-reduce in place; the optimizer reads it whole.
- ZeRO 1: the full buffer persists, plus a 1/dp shard buffer that the reduce-scatter writes. The
  full buffer doubles as the all-gather target for the updated parameters after the step.
- ZeRO 2: only the 1/dp shard buffer persists. A bucket's full storage is allocated at its first
  gradient of the step and freed once its reduce-scatter has completed (in `finish`), so during
  the forward passes, the optimizer step and a checkpoint only the shard exists. It does not
  save memory *during* gradient accumulation: the full buckets live from the first micro-batch's
  backward to `finish` (DeepSpeed avoids that by reducing every micro-batch, at dp× the traffic).
  The parameter all-gather after the step uses a transient full-size buffer (all buckets are
  gathered at once, then copied into the parameters and released).
"""

from __future__ import annotations

import contextlib
import time

import torch

from mscale.parallel.buckets import BufferLayout
from mscale.parallel.reduce import make_comm


class GradBuffer:
    """Bucketed fp32 gradients of ``params`` with DP reduction overlapped with backward."""

    def __init__(self, params: list[torch.nn.Parameter], groups=None, *, zero_stage: int = 0,
                 bucket_bytes: int = 25_000_000, overlap: bool = True, hierarchical: bool = False):
        """``groups``: the rank's ParallelGroups (None: a single process, DP size 1)."""
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, not {zero_stage}")
        self.params = list(params)
        self.groups = groups
        self.zero_stage = zero_stage
        self.overlap = overlap
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.comm = make_comm(groups, hierarchical)
        self.dp_size = self.comm.size
        self.shard_index = self.comm.shard_index
        self.layout = BufferLayout(self.params, self.dp_size, max(1, bucket_bytes // 4))
        nb = len(self.layout.buckets)
        self._full = None if zero_stage == 2 else self._zeros(self.layout.total)
        self._bufs: list[torch.Tensor | None] = [self._bucket_view(b) for b in range(nb)]
        self._offsets = self.layout.owned_offsets()
        self.shard_grad = None if zero_stage == 0 else self._zeros(sum(
            self.layout.shard_numel(b) for b in self.layout.buckets))
        self._sync = True
        self._poison = False
        self._launched_early = 0
        self.overlapped_buckets = 0
        """Buckets whose reduction started during backward in the last step (overlap check)."""
        self._reset_step()
        self._hooks = []
        for s, slot in enumerate(self.layout.slots):
            hook = self._hook(s)
            self._hooks.append(self.params[slot.index].register_post_accumulate_grad_hook(hook))

    # ----------------------------------------------------------------------------- storage
    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _bucket_view(self, b: int) -> torch.Tensor | None:
        if self._full is None:
            return None
        bucket = self.layout.buckets[b]
        return self._full[bucket.start: bucket.start + bucket.padded]

    def _bucket(self, b: int) -> torch.Tensor:
        if self._bufs[b] is None:  # ZeRO-2: storage lives from first gradient to reduction
            self._bufs[b] = self._zeros(self.layout.buckets[b].padded)
        return self._bufs[b]

    @property
    def owned_grad(self) -> torch.Tensor:
        """Reduced gradients over this rank's owned space (after `finish`)."""
        return self._full if self.zero_stage == 0 else self.shard_grad

    @property
    def sharded(self) -> bool:
        """True when each DP rank owns only its shard (ZeRO 1/2)."""
        return self.zero_stage > 0

    # ----------------------------------------------------------------------------- backward
    def _reset_step(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._next = 0
        self._handles = []

    def _hook(self, s: int):
        slot = self.layout.slots[s]

        def on_grad(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            if self._sync and slot.bucket < self._next:
                raise RuntimeError(f"gradient of {slot.spec.name} arrived after its bucket was "
                                   "reduced: run earlier micro-batches inside no_sync()")
            buf = self._bucket(slot.bucket)
            buf[slot.offset: slot.offset + slot.numel].add_(p.grad.reshape(-1))
            p.grad = None
            if self._sync:
                self._pending[slot.bucket] -= 1
                if self.overlap:
                    self._launch_ready()

        return on_grad

    def _launch_ready(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._launched_early += 1

    def _launch(self, b: int) -> None:
        buf = self._bucket(b)
        if self.dp_size > 1:
            buf.div_(self.dp_size)
        out = None
        if self.sharded:
            off = self._offsets[b]
            out = self.shard_grad[off: off + self.layout.shard_numel(self.layout.buckets[b])]
        self._handles.append(self.comm.reduce(buf, out))
        self._next = b + 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communication (all micro-batches but the last)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def finish(self) -> float:
        """Wait for every bucket's reduction; returns the seconds spent blocked (exposed comm).

        Buckets not yet launched (overlap off, or parameters that got no gradient) start here.
        """
        t0 = time.perf_counter()
        while self._next < len(self._pending):
            self._launch(self._next)
        for h in self._handles:
            h.wait()
        waited = time.perf_counter() - t0
        self.overlapped_buckets, self._launched_early = self._launched_early, 0
        if self.zero_stage == 2:
            self._bufs = [None] * len(self._bufs)
        if self._poison:
            pieces = self.layout.pieces(self.shard_index if self.sharded else None)
            self.owned_grad[pieces[0].owned_lo if pieces else 0] = float("nan")
            self._poison = False
        self._reset_step()
        return waited

    def poison_for_test(self) -> None:
        """Make the next `finish` leave a NaN in the reduced gradient (fault-injection tests)."""
        self._poison = True

    # ----------------------------------------------------------------------------- after the step
    def zero_grad(self) -> None:
        """Forget this step's gradients (the optimizer calls it after consuming them)."""
        if self._full is not None:
            self._full.zero_()
        else:
            self._bufs = [None] * len(self._bufs)

    def write_params(self, owned_values: torch.Tensor) -> float:
        """Put updated values over the owned space into the model's parameters.

        ZeRO 1/2 all-gather every bucket's shards first. Returns seconds blocked on that
        communication. Gradients must have been consumed: ZeRO 1 gathers into the gradient
        buffer's storage.
        """
        if not self.sharded or self.dp_size == 1:
            full, waited = owned_values, 0.0
        else:
            full = self._full
            if full is None:
                full = torch.empty(self.layout.total, device=self.device)
            handles = []
            for b in self.layout.buckets:
                n = self.layout.shard_numel(b)
                shard = owned_values[self._offsets[b.index]: self._offsets[b.index] + n]
                handles.append(self.comm.gather(full[b.start: b.start + b.padded], shard))
            t0 = time.perf_counter()
            for h in handles:
                h.wait()
            waited = time.perf_counter() - t0
        with torch.no_grad():
            for s in self.layout.slots:
                start = self.layout.buckets[s.bucket].start + s.offset
                self.params[s.index].copy_(full[start: start + s.numel].view(s.shape))
        return waited

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._hooks:
            h.remove()
        self.comm.close()
