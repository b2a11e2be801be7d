"""The model's parameters as views of one flat buffer, and updated values written back into them.

Split from the gradient buffer (parallel/data.py), which keeps gradients: this module owns the
other side of data parallelism, what the optimizer's updated shards become.

Parameters as views of a flat buffer (Megatron's contiguous parameter buffer). When every
parameter is fp32 on one device (the gradient buffer decides: ``flatten``), they move into one
flat tensor with the gradient buffer's layout (``param.data`` becomes a view; each stays the same
``nn.Parameter``, registered in its module, with its ParamSpec). The ZeRO 1/2 all-gather of
updated shards then writes straight into parameter storage, and where the owned space is the
whole buffer (ZeRO 0, or DP size 1) the optimizer's fp32 master *is* that flat buffer, updated in
place: no copy back. Moving a module (``.to()``) after the buffer is built would break the views.

Deferred gathers, overlapped with the next forward (Megatron's ``overlap_param_gather``; ZeRO 1/2
at DP size > 1 with the flat buffer): once `attach_modules` has installed forward pre-hooks on the
model chunks and one forward has run, `write` launches each bucket's all-gather (the first
layers' bucket, the last one, first) and returns; a module's pre-hook waits for the buckets
holding its own parameters, a root's for parameters that no module's forward was seen to own
(found in that first, observed forward, which rewrites the gather order to put them first).
Readers outside a forward call `wait`.

Every wait here is a `COMM_CLOCK` span, so the step timer counts it as ``comm_wait`` (on a GPU,
the time the compute stream waited for the all-gather); the seconds returned or kept in
`wait_s` are host seconds, for benchmarks.
"""

from __future__ import annotations

import time

import torch

from mscale.distributed.collectives import COMM_CLOCK
from mscale.parallel.buckets import BufferLayout
from mscale.parallel.compile import is_compiled


class ParamGather:
    """Flat parameter storage in ``layout`` and the all-gathers that refill it after a step.

    ``comm``: the DP strategy (parallel/reduce.py), whose ``gather(full, shard)`` returns a
    handle; ``whole``: the owned space is the whole buffer (nothing to gather); ``overlap``: leave
    the all-gathers in flight for the next forward once hooks are attached."""

    def __init__(self, params: list[torch.nn.Parameter], layout: BufferLayout, comm, *,
                 device: torch.device, whole: bool, flatten: bool, overlap: bool = True):
        self.params, self.layout, self.comm = params, layout, comm
        self.device, self.whole, self.overlap = device, whole, overlap
        self._offsets = layout.owned_offsets()
        self.buffer = self._flatten() if flatten and params else None
        """The parameters' flat storage in buffer layout (None unless the gradient buffer found
        them all fp32 on one device); under ZeRO 0 or at DP size 1 the optimizer's master
        weights are this tensor."""
        nb = len(layout.buckets)
        self._gathers: list = [None] * nb
        """Per bucket: the handle of its all-gather still in flight, or None."""
        self._pending = False
        self._order = list(reversed(range(nb)))
        self._hooks: list = []
        self._roots: dict[int, list[int] | None] = {}
        """Per attached root module (id): buckets its own pre-hook waits for (parameters no
        module's forward was seen to own); None until its first forward has been observed."""
        self._seen: set[int] = set()
        self.wait_s = 0.0
        """Host seconds blocked on deferred all-gathers (forward hooks, `wait`)."""

    def _flatten(self) -> torch.Tensor:
        flat = torch.zeros(self.layout.total, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for s in self.layout.slots:
                p = self.params[s.index]
                start = self.layout.buckets[s.bucket].start + s.offset
                view = flat[start: start + s.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(s.shape)
        return flat

    @property
    def in_flight(self) -> int:
        """Buckets whose all-gather is still pending."""
        return sum(h is not None for h in self._gathers)

    # ----------------------------------------------------------------------------- write
    @property
    def deferring(self) -> bool:
        """True when `write` leaves the all-gathers in flight for the forward hooks."""
        return (self.overlap and not self.whole and self.buffer is not None
                and bool(self._roots) and all(v is not None for v in self._roots.values()))

    def write(self, owned_values: torch.Tensor) -> float:
        """Put updated values over the owned space into the model's parameters.

        Nothing to do when ``owned_values`` is the flat buffer itself (the master weights under
        ZeRO 0 / DP size 1). ZeRO 1/2 all-gather every bucket's shards, straight into the flat
        buffer, and either leave them in flight (`deferring`) or wait. Returns host seconds
        blocked on that communication."""
        flat = self.buffer
        if (flat is not None and owned_values.data_ptr() == flat.data_ptr()
                and owned_values.numel() == flat.numel()):
            return 0.0
        self.wait()
        if self.deferring:
            for b in self._order:
                self._gathers[b] = self._launch(b, owned_values, flat)
            self._pending = True
            return 0.0
        if self.whole:
            full, waited = owned_values, 0.0
        else:
            full = flat if flat is not None else torch.empty(self.layout.total, device=self.device)
            handles = [self._launch(b.index, owned_values, full) for b in self.layout.buckets]
            t0 = time.perf_counter()
            with COMM_CLOCK.timed("dp"):
                for h in handles:
                    h.wait()
            waited = time.perf_counter() - t0
            if full is flat:
                return waited
        self._copy_in(full)
        return waited

    def _launch(self, b: int, owned_values: torch.Tensor, full: torch.Tensor):
        bucket = self.layout.buckets[b]
        shard = owned_values[self._offsets[b]: self._offsets[b] + self.layout.shard_numel(bucket)]
        return self.comm.gather(full[bucket.start: bucket.start + bucket.padded], shard)

    def _copy_in(self, full: torch.Tensor) -> None:
        """Copy a whole-buffer tensor into the parameters (no flat buffer, or a separate one)."""
        with torch.no_grad():
            if self.buffer is not None:
                self.buffer.copy_(full)
                return
            for s in self.layout.slots:
                start = self.layout.buckets[s.bucket].start + s.offset
                self.params[s.index].copy_(full[start: start + s.numel].view(s.shape))

    # ----------------------------------------------------------------------------- hooks
    def attach_modules(self, modules: list[torch.nn.Module]) -> None:
        """Install forward pre-hooks on ``modules`` (the model chunks; together they must hold
        every parameter) and their submodules, so that the next forward waits for a bucket's
        all-gather only when a module owning parameters in it runs.

        A parameter read by a forward other than its owner's (e.g. a head weight used through
        ``F.linear`` by the root) is found in the first forward after attaching (no all-gather
        is deferred before that one has run): the root's own pre-hook waits for its bucket, and
        those buckets are gathered first."""
        self.detach_modules()  # attaching again replaces the hooks
        index = {id(self.params[s.index]): s.bucket for s in self.layout.slots}
        covered: set[int] = set()
        for root in modules:
            owners = []
            for sub, own in _hook_owners(root):
                covered.update(id(p) for p in own)
                buckets = sorted({index[id(p)] for p in own if id(p) in index}, reverse=True)
                if buckets:
                    self._hooks.append(sub.register_forward_pre_hook(
                        self._module_hook(id(sub), buckets)))
                    owners.append((id(sub), buckets))
            self._roots[id(root)] = None
            self._hooks.append(root.register_forward_pre_hook(self._root_hook(id(root)),
                                                              prepend=True))
            self._hooks.append(root.register_forward_hook(self._observe(id(root), owners)))
        missing = [p for p in self.params if id(p) not in covered]
        if missing:
            self.detach_modules()
            raise ValueError(f"{len(missing)} parameters of the buffer are in none of the modules")

    def _module_hook(self, key: int, buckets: list[int]):
        def pre(module, args) -> None:
            if self._pending:
                self._wait(buckets)
            elif key not in self._seen:
                self._seen.add(key)
        return pre

    def _root_hook(self, key: int):
        def pre(module, args) -> None:
            orphans = self._roots[key]
            if self._pending and orphans:
                self._wait(orphans)
        return pre

    def _observe(self, key: int, owners: list[tuple[int, list[int]]]):
        """After the root's first forward: the buckets of every hooked module whose hook did not
        run (its parameters were read by another module's forward) become the root's to wait
        for. Judged over the hooked modules, not all submodules: the modules inside a compiled
        region have no hook of their own (their parent waits for them), and counting them as
        unseen made the root wait for every bucket, so no all-gather overlapped the forward."""

        def post(module, args, output) -> None:
            if self._roots.get(key, 0) is not None:  # observed already (or detached)
                return
            orphans = {b for sub, buckets in owners if sub not in self._seen for b in buckets}
            self._roots[key] = sorted(orphans, reverse=True)
            if all(v is not None for v in self._roots.values()):
                first = sorted({b for v in self._roots.values() for b in v}, reverse=True)
                rest = [b for b in reversed(range(len(self.layout.buckets))) if b not in first]
                self._order = first + rest
        return post

    def _wait(self, buckets) -> None:
        # Inside a forward this wait is exposed communication: COMM_CLOCK hands it to the step's
        # comm_wait, so the straggler rule (highest compute, lowest wait) still holds.
        t0 = time.perf_counter()
        with COMM_CLOCK.timed("dp"):
            for b in buckets:
                h = self._gathers[b]
                if h is not None:
                    h.wait()
                    self._gathers[b] = None
        if all(h is None for h in self._gathers):
            self._pending = False
        self.wait_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Wait for every all-gather still in flight. Call it before reading the parameters
        outside a forward (checkpoint, evaluation, state dicts, end of training)."""
        if self._pending:
            self._wait(self._order)

    def detach_modules(self) -> None:
        """Remove the forward hooks (pending all-gathers are waited for first)."""
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks, self._roots, self._seen = [], {}, set()


def _hook_owners(root: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.Tensor]]]:
    """Every module under ``root`` with the parameters its pre-hook waits for: its own, except
    that a module compiled in place (parallel/compile.py) gets no hook of its own, which its
    compiled graph would have to trace, and its parameters go to the nearest uncompiled
    ancestor's hook."""
    out, seen = [], set()

    def visit(module: torch.nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        own = [p for p in module._parameters.values() if p is not None]
        out.append((module, own))
        for child in module.children():
            if is_compiled(child):
                own.extend(child.parameters())
            else:
                visit(child)
    visit(root)
    return out
