"""Data parallelism: a flat fp32 gradient buffer in buckets, reduced while backward still runs.

Per step the training loop does::

    for i, mb in enumerate(micro_batches):
        with grads.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss(mb) / len(micro_batches)).backward()
    grads.finish()                      # waits for the reduction (returns host seconds blocked)
    # then the optimizer (parallel/zero.py): grad_norm(), step(lr, clip_coef)

Gradients as views of the buffer (DDP's ``gradient_as_bucket_view``). Each fp32 parameter's
``.grad`` is a view of its place in the bucket, so autograd's AccumulateGrad adds every
micro-batch's gradient in place into the buffer (outside ``create_graph`` it does
``grad += new``, keeping the tensor) and the post-accumulate-grad hook only counts readiness. The
sum is the one the buffer always held, ``0 + g1 + g2 + ...`` in the same order: bit-identical to
copying. A gradient that is not the view when the hook runs (a parameter that is not fp32, or a
``.grad`` someone replaced or set to None) is added into the buffer as before and the view is put
back (non-fp32 parameters: ``.grad`` is released instead). ``create_graph=True`` backward is
refused: AccumulateGrad then builds ``grad + new`` out of place.

The parameters themselves, as views of one flat buffer with this layout, and the all-gather of
updated shards back into them (possibly deferred to the next forward) are `ParamGather`'s job
(parallel/param_gather.py). `data_parallel` builds the two over one layout, one DP strategy and
one `BufferMode`; the engine and the optimizer hold both.

On the last micro-batch (outside `no_sync`) each bucket's reduction starts as soon as its last
gradient has arrived. Buckets are launched strictly in bucket order (a ready bucket waits for
earlier ones) so every rank issues the same collectives in the same order even if hooks fire in
a slightly different order. Reduction = mean over the DP group: each bucket is divided by the DP
size, then summed.

Memory, honestly (gradients; the parameters themselves are the flat parameter buffer, the
model's own size plus at most dp-1 padding elements per bucket):
- ZeRO 0: the full gradient buffer persists, and ``param.grad`` views it (no per-parameter
  gradient tensors); all-reduce in place; the optimizer reads it whole.
- ZeRO 1: the full buffer persists, plus a 1/dp shard buffer that the reduce-scatter writes.
- ZeRO 2: only the 1/dp shard buffer persists. A bucket's full storage is allocated at its first
  gradient of the step (the parameters of that bucket get their ``.grad`` views then) and freed
  once its reduce-scatter has completed (in `finish`, which also sets those ``.grad`` to None),
  so during the forward passes, the optimizer step and a checkpoint only the shard exists. It
  does not save memory *during* gradient accumulation: the full buckets live from the first
  micro-batch's backward to `finish` (DeepSpeed avoids that by reducing every micro-batch, at
  dp× the traffic). The parameter all-gather after the step writes straight into the flat
  parameter buffer (no transient full-size buffer; with non-fp32 parameters it falls back to a
  transient buffer and a copy per parameter).
- DP size 1 (any stage): nothing to shard. The reduced gradient is the full buffer itself (no
  shard buffer, no copy) and the buffer persists, at most the size ZeRO 1/2 would use there.
"""

from __future__ import annotations

import contextlib
import time

import torch

from mscale.parallel.buckets import BufferLayout, BufferMode
from mscale.parallel.param_gather import ParamGather
from mscale.parallel.reduce import make_comm
from mscale.parallel.shard_layout import bucket_numel
from mscale.parallel.spec import ParamTable


class GradBuffer:
    """Bucketed fp32 gradients of ``params`` with DP reduction overlapped with backward.

    One job: gradient storage (the ``.grad`` views), which bucket's reduction starts when, and
    the reduced gradient over the owned space. The parameters' flat storage and the all-gathers
    that refill it are `ParamGather`'s (param_gather.py); `data_parallel` builds both."""

    def __init__(self, params: list[torch.nn.Parameter], layout: BufferLayout, comm,
                 mode: BufferMode, *, overlap: bool = True):
        """``layout``: the buckets over ``params``; ``comm``: the DP strategy (reduce.py);
        ``mode``: what this rank owns and how long bucket storage lives; ``overlap``: start each
        bucket's reduction as soon as its gradients are in (else all in `finish`)."""
        self.params, self.layout, self.comm, self.mode = list(params), layout, comm, mode
        self.overlap = overlap
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.dp_size = comm.size
        self.shard = None if mode is BufferMode.WHOLE else comm.shard_index
        """The shard of every bucket this rank owns; None: the whole buffer."""
        self.pieces = layout.pieces(self.shard)
        """The owned space, run by run (what the optimizer updates and a checkpoint saves)."""
        nb = len(layout.buckets)
        self._full = None if mode is BufferMode.TRANSIENT else self._zeros(layout.total)
        self._bufs: list[torch.Tensor | None] = [self._bucket_view(b) for b in range(nb)]
        self._offsets = layout.owned_offsets()
        shard_numel = sum(layout.shard_numel(b) for b in layout.buckets)
        self._shard_grad = self._full if mode is BufferMode.WHOLE else self._zeros(shard_numel)
        self._as_view = [_viewable(self.params[s.index], self.device) for s in layout.slots]
        self._views: list[torch.Tensor | None] = [None] * len(layout.slots)
        self._sync = True
        self._launched_early = 0
        self.overlapped_buckets = 0
        """Buckets whose reduction started during backward in the last step (overlap check)."""
        self._reset_step()
        for b in range(nb):
            if self._bufs[b] is not None:
                self._attach_views(b, keep=True)
        self._hooks = []
        for s, slot in enumerate(layout.slots):
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
            self._attach_views(b)
        return self._bufs[b]

    def _attach_views(self, b: int, keep: bool = False) -> None:
        """Make ``.grad`` of bucket ``b``'s fp32 parameters views of its storage. A parameter
        that already has a gradient keeps it (added into the buffer by its hook), except at
        construction (``keep``) where it is copied into the view."""
        buf = self._bufs[b]
        for si in self.layout.buckets[b].slots:
            if not self._as_view[si]:
                continue
            slot = self.layout.slots[si]
            p = self.params[slot.index]
            view = buf[slot.offset: slot.offset + slot.numel].view(slot.shape)
            self._views[si] = view
            if p.grad is None or keep:
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def _detach_views(self, b: int) -> None:
        """Drop the ``.grad`` views of bucket ``b`` (its storage is being released)."""
        for si in self.layout.buckets[b].slots:
            view = self._views[si]
            if view is not None:
                p = self.params[self.layout.slots[si].index]
                if p.grad is view:
                    p.grad = None
                self._views[si] = None

    @property
    def owned_grad(self) -> torch.Tensor:
        """Reduced gradients over this rank's owned space (after `finish`)."""
        return self._shard_grad

    # ----------------------------------------------------------------------------- backward
    def _reset_step(self) -> None:
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._next = 0
        self._handles = []

    def _hook(self, s: int):
        slot = self.layout.slots[s]
        lo, hi = slot.offset, slot.offset + slot.numel

        def on_grad(p: torch.Tensor) -> None:
            grad = p.grad
            if grad is None:
                return
            if self._sync and slot.bucket < self._next:
                raise RuntimeError(f"gradient of {slot.spec.name} arrived after its bucket was "
                                   "reduced: run earlier micro-batches inside no_sync()")
            if grad is not self._views[s]:  # not accumulated in place: add it, restore the view
                if torch.is_grad_enabled():
                    raise RuntimeError("GradBuffer does not support backward(create_graph=True)")
                self._bucket(slot.bucket)[lo:hi].add_(grad.reshape(-1))
                p.grad = self._views[s]  # None for a parameter that is not fp32
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
        if self.mode is not BufferMode.WHOLE:
            off = self._offsets[b]
            out = self._shard_grad[off: off + self.layout.shard_numel(self.layout.buckets[b])]
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
        if self.mode is BufferMode.TRANSIENT:
            self._release_buckets()
        self._reset_step()
        return waited

    def _release_buckets(self) -> None:
        for b in range(len(self._bufs)):
            if self._bufs[b] is not None:
                self._detach_views(b)
                self._bufs[b] = None

    # ----------------------------------------------------------------------------- after the step
    def zero_grad(self) -> None:
        """Forget this step's gradients (the optimizer calls it after consuming them)."""
        if self._full is not None:
            self._full.zero_()
        else:
            self._release_buckets()

    def close(self) -> None:
        """Remove the hooks, drop the ``.grad`` views and close the DP strategy (wait for the
        parameter buffer's all-gathers first: `ParamGather.wait`)."""
        for h in self._hooks:
            h.remove()
        for b in range(len(self._bufs)):
            self._detach_views(b)
        self.comm.close()


def _viewable(p: torch.Tensor, device: torch.device) -> bool:
    """Whether ``p`` can live in the flat fp32 buffers as a view (else it is copied)."""
    return p.dtype == torch.float32 and p.device == device and p.layout == torch.strided


def data_parallel(params: list[torch.nn.Parameter], table: ParamTable, groups=None, *,
                  zero_stage: int = 0, bucket_bytes: int = 25_000_000, overlap: bool = True,
                  hierarchical: bool = False,
                  overlap_param_gather: bool = True) -> tuple[GradBuffer, ParamGather]:
    """The gradient buffer and the parameter buffer of ``params`` (with their ``table``, from
    the parallelize step) for this rank's DP group (``groups``: ParallelGroups, None: one
    process): one bucket layout, one DP strategy and one `BufferMode` shared by both.

    ``overlap``: reduce buckets during backward; ``overlap_param_gather``: under ZeRO 1/2 at DP
    size > 1, leave the parameter all-gathers in flight for the next forward, which waits per
    bucket once `ParamGather.attach_modules` has installed its hooks."""
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    comm = make_comm(groups, hierarchical, device)
    mode = BufferMode.of(zero_stage, comm.size)
    layout = BufferLayout(params, table, comm.size, bucket_numel(bucket_bytes))
    flatten = bool(params) and all(_viewable(p, device) for p in params)
    param_buffer = ParamGather(params, layout, comm, device=device,
                               whole=mode is BufferMode.WHOLE, flatten=flatten,
                               overlap=overlap_param_gather)
    return GradBuffer(params, layout, comm, mode, overlap=overlap), param_buffer
