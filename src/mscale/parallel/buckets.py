"""Where every gradient lives in the flat data-parallel buffer, and which DP rank owns what.

Pure bookkeeping, no communication, so it is unit-tested on its own:

- Parameters are laid out in *reverse* registration order: backward produces the last layers'
  gradients first, so the first bucket fills first and its reduction can start while the earlier
  layers are still computing.
- A bucket holds whole parameters (one is never split across buckets) until it reaches the size
  cap; it is padded to a multiple of the DP size so a reduce-scatter gives every rank an equal
  shard.
- Under ZeRO 1/2 a rank owns shard ``s`` of *every* bucket (Megatron's distributed optimizer
  does the same): ownership is spread evenly and each bucket's reduce-scatter delivers exactly
  the owner's piece. The *owned space* is the concatenation of those shards in bucket order;
  master weights, optimizer state and reduced gradients are flat tensors over it. Under ZeRO 0
  the owned space is the whole buffer.
- A `Piece` maps one contiguous run of the owned space to a range of one parameter's *local*
  flattened tensor (row-major over the shape this rank holds, i.e. its TP slice
  ``spec.tp_slice(tp_rank, tp_size)`` of ``spec.global_shape``). Within one bucket a rank's shard
  is contiguous, so a rank holds at most one piece of any parameter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mscale.parallel.spec import ParamSpec, ParamTable


class BufferMode(enum.Enum):
    """What a rank owns of the buffer and how long gradient storage lives: one value, decided
    once from the ZeRO stage and the DP size, read by the gradient buffer, the parameter buffer
    and the optimizer alike."""

    WHOLE = "whole"
    """ZeRO 0, or DP size 1: the owned space is the whole buffer. Buckets are all-reduced (or
    not reduced at all); the optimizer's master weights are the parameters' flat storage."""
    SHARDED = "sharded"
    """ZeRO 1 at DP > 1: the full gradient buffer persists; each bucket is reduce-scattered
    into this rank's shard, and updated shards are all-gathered back into the parameters."""
    TRANSIENT = "transient"
    """ZeRO 2 at DP > 1: as SHARDED, but a bucket's full storage lives only from the step's
    first gradient to `GradBuffer.finish`; between steps only the shard exists."""

    @classmethod
    def of(cls, zero_stage: int, dp_size: int) -> "BufferMode":
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2, not {zero_stage}")
        if zero_stage == 0 or dp_size == 1:
            return cls.WHOLE
        return cls.SHARDED if zero_stage == 1 else cls.TRANSIENT


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    index: int
    """Registration index in the parameter list given to the buffer."""
    spec: ParamSpec
    shape: tuple[int, ...]
    """Local shape (the TP slice this rank holds)."""
    bucket: int
    offset: int
    """Offset inside its bucket."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Bucket:
    """A run of the buffer reduced by one collective."""

    index: int
    start: int
    """Offset of the bucket in the whole flat buffer."""
    numel: int
    """Gradient elements (without padding)."""
    padded: int
    """``numel`` rounded up to a multiple of the DP size."""
    slots: list[int]
    """Indices (into `BufferLayout.slots`) of the parameters it holds, in layout order."""


@dataclass(frozen=True)
class Piece:
    """One contiguous run of the owned space that belongs to one parameter."""

    param_index: int
    name: str
    param_lo: int
    """Start of the range inside the parameter's local flattened tensor."""
    param_hi: int
    owned_lo: int
    """Start of the same run inside the owned flat space."""

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo

    @property
    def owned_hi(self) -> int:
        return self.owned_lo + self.numel


class BufferLayout:
    """Buckets over a parameter list for a DP group of ``dp_size`` ranks."""

    def __init__(self, params: list[torch.nn.Parameter], table: ParamTable, dp_size: int,
                 bucket_numel: int):
        """``table``: the specs of ``params``, in the same order (the parallelize step's)."""
        if bucket_numel < 1:
            raise ValueError("bucket size must hold at least one element")
        self.dp_size = dp_size
        self.slots: list[Slot] = []
        self.buckets: list[Bucket] = []
        start, cur, fill = 0, [], 0
        if len(table) != len(params):
            raise ValueError(f"{len(params)} parameters but {len(table)} specs")
        for index in reversed(range(len(params))):
            p = params[index]
            slot = Slot(index, table[index], tuple(p.shape), len(self.buckets), fill)
            self.slots.append(slot)
            cur.append(len(self.slots) - 1)
            fill += slot.numel
            if fill >= bucket_numel:
                start = self._close(start, cur, fill)
                cur, fill = [], 0
        if cur:
            self._close(start, cur, fill)
        self.by_param = {s.index: s for s in self.slots}

    def _close(self, start: int, slots: list[int], fill: int) -> int:
        padded = -(-fill // self.dp_size) * self.dp_size
        self.buckets.append(Bucket(len(self.buckets), start, fill, padded, slots))
        return start + padded

    @property
    def total(self) -> int:
        """Elements of the flat buffer, padding included."""
        return sum(b.padded for b in self.buckets)

    def shard_numel(self, bucket: Bucket) -> int:
        return bucket.padded // self.dp_size

    def owned_offsets(self) -> list[int]:
        """Start of each bucket's shard in the owned space (ZeRO 1/2)."""
        out, acc = [], 0
        for b in self.buckets:
            out.append(acc)
            acc += self.shard_numel(b)
        return out

    def pieces(self, shard_index: int | None) -> list[Piece]:
        """The owned pieces of shard ``shard_index``, or of the whole buffer when None (ZeRO 0)."""
        out = []
        offsets = self.owned_offsets()
        for b in self.buckets:
            if shard_index is None:
                lo, hi, base = 0, b.padded, b.start
            else:
                n = self.shard_numel(b)
                lo, hi = shard_index * n, (shard_index + 1) * n
                base = offsets[b.index] - lo
            for si in b.slots:
                s = self.slots[si]
                a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < z:
                    out.append(Piece(s.index, s.spec.name, a - s.offset, z - s.offset, base + a))
        return out
