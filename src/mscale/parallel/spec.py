"""What every parameter is in the global model: the table the parallelize step builds.

`ParamTable` lists one `ParamSpec` per parameter of a parallelized model, in `parameters()` order.
The data-parallel buffers use it to count a TP-replicated parameter once in the gradient norm and
to skip weight decay on norms; the checkpoint uses it to write each shard's slice of the global
tensor; initialisation uses it to give each shard its slice of the global initial value. It is
data held by whoever needs it, not an attribute on the `nn.Parameter`s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's identity in the unsharded model."""

    name: str
    """Global name, identical at every layout, e.g. ``layers.3.attn.wq.weight``."""
    global_shape: tuple[int, ...]
    """Shape of the full tensor before tensor-parallel sharding."""
    tp_dim: int | None
    """Dimension split over the TP group (rank i holds chunk i); None = replicated on TP ranks."""
    weight_decay: bool = True
    """False for norms and other gains that decay would pull to zero."""

    def tp_slice(self, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
        """The slice of the global tensor that TP rank ``tp_rank`` holds."""
        out = [slice(None)] * len(self.global_shape)
        if self.tp_dim is not None and tp_size > 1:
            n = self.global_shape[self.tp_dim] // tp_size
            out[self.tp_dim] = slice(tp_rank * n, (tp_rank + 1) * n)
        return tuple(out)


@dataclass(frozen=True)
class ParamTable:
    """The specs of a rank's parameters (all its model chunks), in `parameters()` order."""

    specs: tuple[ParamSpec, ...]
    tp_rank: int = 0
    tp_size: int = 1

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, i: int) -> ParamSpec:
        return self.specs[i]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def local_slice(self, spec: ParamSpec) -> tuple[slice, ...]:
        """The slice of ``spec``'s global tensor that this rank holds."""
        return spec.tp_slice(self.tp_rank, self.tp_size)

    def __add__(self, other: "ParamTable") -> "ParamTable":
        """The table of two chunks of one rank, in order (interleaved pipelining)."""
        if (other.tp_rank, other.tp_size) != (self.tp_rank, self.tp_size):
            raise ValueError("chunks of one rank share its TP coordinates")
        return ParamTable(self.specs + other.specs, self.tp_rank, self.tp_size)
