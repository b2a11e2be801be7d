"""Data parallelism: a flat fp32 gradient buffer in buckets, reduced while backward still runs.

Per step the training loop does::

    for i, mb in enumerate(micro_batches):
        with grads.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss(mb) / len(micro_batches)).backward()
    comm_wait = grads.finish()          # seconds blocked on DP communication (exposed)
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

Parameters as views of a flat buffer (Megatron's contiguous parameter buffer). When every
parameter is fp32 on one device, the GradBuffer moves them into one flat tensor with the
gradient buffer's layout (``param.data`` becomes a view; each stays the same ``nn.Parameter``,
registered in its module, with its ParamSpec). The ZeRO 1/2 all-gather of updated shards then
writes straight into parameter storage, and where the owned space is the whole buffer (ZeRO 0,
or DP size 1) the optimizer's fp32 master *is* that flat buffer, updated in place: no copy back.
Moving a module (``.to()``) after the buffer is built would break the views; build it last.

On the last micro-batch (outside `no_sync`) each bucket's reduction starts as soon as its last
gradient has arrived. Buckets are launched strictly in bucket order (a ready bucket waits for
earlier ones) so every rank issues the same collectives in the same order even if hooks fire in
a slightly different order. Reduction = mean over the DP group: each bucket is divided by the DP
size, then summed.

Parameter all-gather overlapped with the next forward (Megatron's ``overlap_param_gather``;
ZeRO 1/2 at DP size > 1 with the flat parameter buffer): once `attach_modules` has installed
forward pre-hooks on the model chunks and one forward has run, `write_params` launches each
bucket's all-gather (the first layers' bucket, the last one, first) and returns; a module's
pre-hook waits for the buckets holding its own parameters, a root's for parameters that no
module's forward was seen to own. Readers outside a forward call `wait_params`.

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

from mscale.dist.collectives import COMM_CLOCK
from mscale.parallel.buckets import BufferLayout
from mscale.parallel.reduce import make_comm


class GradBuffer:
    """Bucketed fp32 gradients of ``params`` with DP reduction overlapped with backward."""

    def __init__(self, params: list[torch.nn.Parameter], groups=None, *, zero_stage: int = 0,
                 bucket_bytes: int = 25_000_000, overlap: bool = True, hierarchical: bool = False,
                 overlap_param_gather: bool = True):
        """``groups``: the rank's ParallelGroups (None: a single process, DP size 1).

        ``overlap_param_gather``: under ZeRO 1/2 at DP size > 1, `write_params` only launches the
        all-gathers and the next forward waits for each bucket when a module owning parameters
        in it is about to run. Takes effect once `attach_modules` has installed those hooks."""
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
        self._whole = zero_stage == 0 or self.dp_size == 1
        """The owned space is the whole buffer: no reduce-scatter target, no sharded master."""
        self._transient = not self._whole and zero_stage == 2
        """ZeRO 2 at dp > 1: bucket storage lives from the step's first gradient to `finish`."""
        self._full = None if self._transient else self._zeros(self.layout.total)
        self._bufs: list[torch.Tensor | None] = [self._bucket_view(b) for b in range(nb)]
        self._offsets = self.layout.owned_offsets()
        shard_numel = sum(self.layout.shard_numel(b) for b in self.layout.buckets)
        self.shard_grad = (None if zero_stage == 0 else self._full if self._whole else
                           self._zeros(shard_numel))
        self._as_view = [self._viewable(self.params[s.index]) for s in self.layout.slots]
        self._views: list[torch.Tensor | None] = [None] * len(self.layout.slots)
        self.param_buffer = self._flatten_params()
        """The parameters' flat storage in buffer layout (None unless all are fp32 on one
        device); under ZeRO 0 or at DP size 1 the optimizer's master weights are this tensor."""
        self._sync = True
        self._poison = False
        self._launched_early = 0
        self.overlapped_buckets = 0
        """Buckets whose reduction started during backward in the last step (overlap check)."""
        self._reset_step()
        for b in range(nb):
            if self._bufs[b] is not None:
                self._attach_views(b, keep=True)
        self.overlap_param_gather = overlap_param_gather
        self._gathers: list = [None] * nb
        """Per bucket: the handle of its parameter all-gather still in flight, or None."""
        self._gather_pending = False
        self._module_hooks: list = []
        self._roots: dict[int, list[int] | None] = {}
        """Per attached root module (id): buckets its own pre-hook waits for (parameters no
        module's forward was seen to own); None until its first forward has been observed."""
        self._seen: set[int] = set()
        self._gather_order = list(reversed(range(nb)))
        self.param_wait_s = 0.0
        """Seconds blocked on deferred parameter all-gathers (forward hooks, `wait_params`)."""
        self._hooks = []
        for s, slot in enumerate(self.layout.slots):
            hook = self._hook(s)
            self._hooks.append(self.params[slot.index].register_post_accumulate_grad_hook(hook))

    # ----------------------------------------------------------------------------- storage
    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _viewable(self, p: torch.Tensor) -> bool:
        return p.dtype == torch.float32 and p.device == self.device and p.layout == torch.strided

    def _flatten_params(self) -> torch.Tensor | None:
        """Move every parameter into one flat fp32 tensor laid out as the gradient buffer."""
        if not self.params or not all(self._as_view):
            return None
        flat = self._zeros(self.layout.total)
        with torch.no_grad():
            for s in self.layout.slots:
                p = self.params[s.index]
                start = self.layout.buckets[s.bucket].start + s.offset
                view = flat[start: start + s.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(s.shape)
        return flat

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
        return self._full if self._whole else self.shard_grad

    @property
    def owns_whole_buffer(self) -> bool:
        """True when the owned space is the whole buffer (ZeRO 0, or DP size 1)."""
        return self._whole

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
        if not self._whole:
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
        if self._transient:
            self._release_buckets()
        if self._poison:
            pieces = self.layout.pieces(self.shard_index if self.sharded else None)
            self.owned_grad[pieces[0].owned_lo if pieces else 0] = float("nan")
            self._poison = False
        self._reset_step()
        return waited

    def _release_buckets(self) -> None:
        for b in range(len(self._bufs)):
            if self._bufs[b] is not None:
                self._detach_views(b)
                self._bufs[b] = None

    def poison_for_test(self) -> None:
        """Make the next `finish` leave a NaN in the reduced gradient (fault-injection tests)."""
        self._poison = True

    # ----------------------------------------------------------------------------- after the step
    def zero_grad(self) -> None:
        """Forget this step's gradients (the optimizer calls it after consuming them)."""
        if self._full is not None:
            self._full.zero_()
        else:
            self._release_buckets()

    def write_params(self, owned_values: torch.Tensor) -> float:
        """Put updated values over the owned space into the model's parameters.

        Nothing to do when ``owned_values`` is the flat parameter buffer itself (the master
        weights under ZeRO 0 / DP size 1). ZeRO 1/2 all-gather every bucket's shards, straight
        into the parameter buffer. Returns seconds blocked on that communication.
        """
        flat = self.param_buffer
        if (flat is not None and owned_values.data_ptr() == flat.data_ptr()
                and owned_values.numel() == flat.numel()):
            return 0.0
        self.wait_params()
        if self.deferring_param_gather:
            for b in self._gather_order:
                bucket = self.layout.buckets[b]
                n = self.layout.shard_numel(bucket)
                shard = owned_values[self._offsets[b]: self._offsets[b] + n]
                full = flat[bucket.start: bucket.start + bucket.padded]
                self._gathers[b] = self.comm.gather(full, shard)
            self._gather_pending = True
            return 0.0
        if self._whole:
            full, waited = owned_values, 0.0
        else:
            full = flat if flat is not None else torch.empty(self.layout.total, device=self.device)
            handles = []
            for b in self.layout.buckets:
                n = self.layout.shard_numel(b)
                shard = owned_values[self._offsets[b.index]: self._offsets[b.index] + n]
                handles.append(self.comm.gather(full[b.start: b.start + b.padded], shard))
            t0 = time.perf_counter()
            for h in handles:
                h.wait()
            waited = time.perf_counter() - t0
            if full is flat:
                return waited
        with torch.no_grad():
            if flat is not None:
                flat.copy_(full)
                return waited
            for s in self.layout.slots:
                start = self.layout.buckets[s.bucket].start + s.offset
                self.params[s.index].copy_(full[start: start + s.numel].view(s.shape))
        return waited

    # ----------------------------------------------------------------------------- deferred gather
    @property
    def deferring_param_gather(self) -> bool:
        """True when `write_params` leaves the all-gathers in flight for the forward hooks."""
        return (self.overlap_param_gather and not self._whole and self.param_buffer is not None
                and bool(self._roots) and all(v is not None for v in self._roots.values()))

    def attach_modules(self, modules: list[torch.nn.Module]) -> None:
        """Install forward pre-hooks on ``modules`` (the model chunks; together they must hold
        every parameter of the buffer) and their submodules, so that the next forward waits for
        a bucket's parameter all-gather only when a module owning parameters in it runs.

        A parameter read by a forward other than its owner's (e.g. a head weight used through
        ``F.linear`` by the root) is found in the first forward after attaching (no all-gather
        is deferred before that one has run): the root's own pre-hook waits for its bucket, and
        those buckets are gathered first."""
        self.detach_modules()  # attaching again replaces the hooks
        index = {id(self.params[s.index]): s.bucket for s in self.layout.slots}
        covered: set[int] = set()
        for root in modules:
            for sub in root.modules():
                buckets = sorted({index[id(p)] for p in sub._parameters.values()
                                  if p is not None and id(p) in index}, reverse=True)
                covered.update(id(p) for p in sub._parameters.values() if p is not None)
                if buckets:
                    self._module_hooks.append(sub.register_forward_pre_hook(
                        self._module_hook(id(sub), buckets)))
            self._roots[id(root)] = None
            self._module_hooks.append(root.register_forward_pre_hook(self._root_hook(id(root)),
                                                                     prepend=True))
            self._module_hooks.append(root.register_forward_hook(self._observe(root, index)))
        missing = [p for p in self.params if id(p) not in covered]
        if missing:
            self.detach_modules()
            raise ValueError(f"{len(missing)} parameters of the buffer are in none of the modules")

    def _module_hook(self, key: int, buckets: list[int]):
        def pre(module, args) -> None:
            if self._gather_pending:
                self._wait(buckets)
            elif key not in self._seen:
                self._seen.add(key)
        return pre

    def _root_hook(self, key: int):
        def pre(module, args) -> None:
            orphans = self._roots[key]
            if self._gather_pending and orphans:
                self._wait(orphans)
        return pre

    def _observe(self, root: torch.nn.Module, index: dict[int, int]):
        key = id(root)

        def post(module, args, output) -> None:
            if self._roots.get(key, 0) is not None:  # observed already (or detached)
                return
            orphans = set()
            for sub in root.modules():
                if id(sub) not in self._seen:
                    orphans.update(index[id(p)] for p in sub._parameters.values()
                                   if p is not None and id(p) in index)
            self._roots[key] = sorted(orphans, reverse=True)
            if all(v is not None for v in self._roots.values()):
                first = sorted({b for v in self._roots.values() for b in v}, reverse=True)
                rest = [b for b in reversed(range(len(self.layout.buckets))) if b not in first]
                self._gather_order = first + rest
        return post

    def _wait(self, buckets) -> None:
        # Inside a forward this wait is exposed communication: COMM_CLOCK hands it to the step's
        # comm_wait, so the straggler rule (highest compute, lowest wait) still holds.
        t0 = time.perf_counter()
        with COMM_CLOCK.timed():
            for b in buckets:
                h = self._gathers[b]
                if h is not None:
                    h.wait()
                    self._gathers[b] = None
        if all(h is None for h in self._gathers):
            self._gather_pending = False
        self.param_wait_s += time.perf_counter() - t0

    def wait_params(self) -> None:
        """Wait for every parameter all-gather still in flight. Call it before reading the
        parameters outside a forward (checkpoint, evaluation, state dicts, end of training)."""
        if self._gather_pending:
            self._wait(self._gather_order)

    def detach_modules(self) -> None:
        """Remove the forward hooks (pending all-gathers are waited for first)."""
        self.wait_params()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks, self._roots, self._seen = [], {}, set()

    def close(self) -> None:
        """Remove the hooks, drop the ``.grad`` views and stop the communication thread."""
        self.detach_modules()
        for h in self._hooks:
            h.remove()
        for b in range(len(self._bufs)):
            self._detach_views(b)
        self.comm.close()
