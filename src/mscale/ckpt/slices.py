"""Where a piece of a tensor sits in the global tensor: boxes, flat ranges, and copies between them.

Every piece of state a rank holds is a *region* of a global tensor: a box (the TP slice, one
``[start, stop)`` per dimension) and a flat range ``[lo, hi)`` of that box's row-major
flattening (a ZeRO shard cuts the TP-local tensor as a flat vector, through rows). Saving and
loading at different layouts both reduce to one operation: copy the overlap of a source region
into a destination region.

A flat range is not a box, but it is a union of at most ``2·ndim - 1`` boxes, each one a
contiguous run of the flattening (`flat_to_boxes`). Two boxes intersect in a box, so the overlap
of two regions is a handful of box intersections, each copied with one strided view on either
side, and only the source elements spanning the intersection need to be read.

Pure index arithmetic on Python ints and torch views: no I/O, no process groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # the arithmetic needs no torch: `ckpt verify` and `recover` import it alone
    import torch

Box = tuple[tuple[int, int], ...]
"""``((start, stop), ...)``, one pair per dimension; ``()`` is a scalar."""


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, d) for d in shape)


def box_from_slices(slices: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box of ``tensor[slices]`` (step-1 slices, as `ParamSpec.tp_slice` returns)."""
    return tuple(s.indices(d)[:2] for s, d in zip(slices, shape))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def span(outer: Box, inner: Box) -> tuple[int, int]:
    """Flat positions, in ``outer``'s row-major order, of ``inner``'s first and one past its last
    element: every element of ``inner`` lies in that range."""
    strides = contiguous_strides(box_shape(outer))
    first = sum((lo - o) * s for (lo, _), (o, _), s in zip(inner, outer, strides))
    last = sum((hi - 1 - o) * s for (_, hi), (o, _), s in zip(inner, outer, strides))
    return first, last + 1


def flat_to_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[Box, int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes, each a contiguous run,
    with each box's offset from ``lo``. At most ``2·len(shape) - 1`` boxes: a partial first row,
    whole rows, a partial last row, recursively."""
    if lo >= hi:
        return []
    if not shape:
        return [((), 0)]
    if len(shape) == 1:
        return [(((lo, hi),), 0)]
    inner = numel(shape[1:])
    r0, c0 = divmod(lo, inner)
    r1, c1 = divmod(hi, inner)
    if r0 == r1:
        return [(((r0, r0 + 1), *b), off) for b, off in flat_to_boxes(shape[1:], c0, c1)]
    out: list[tuple[Box, int]] = []
    pos = 0
    if c0:
        out += [(((r0, r0 + 1), *b), off) for b, off in flat_to_boxes(shape[1:], c0, inner)]
        pos, r0 = inner - c0, r0 + 1
    if r1 > r0:
        out.append((((r0, r1), *full_box(shape[1:])), pos))
        pos += (r1 - r0) * inner
    if c1:
        out += [(((r1, r1 + 1), *b), pos + off) for b, off in flat_to_boxes(shape[1:], 0, c1)]
    return out


def region_boxes(box: Box, flat: tuple[int, int]) -> list[tuple[Box, int]]:
    """A region (box + flat range of it) as global boxes with their offsets in the region's data."""
    starts = [a for a, _ in box]
    return [(tuple((a + s, b + s) for (a, b), s in zip(sub, starts)), off)
            for sub, off in flat_to_boxes(box_shape(box), flat[0], flat[1])]


def rows_box(box: Box, flat: tuple[int, int]) -> Box:
    """The smallest box of whole leading-dimension rows of ``box`` holding the flat range: what a
    reader must fetch to cut a flat ZeRO shard out of a differently split tensor."""
    if not box:
        return box
    inner = numel(box_shape(box)[1:])
    r0, r1 = flat[0] // inner, -(-flat[1] // inner)
    return ((box[0][0] + r0, box[0][0] + r1), *box[1:])


def _view(data: torch.Tensor, outer: Box, inner: Box, base: int) -> torch.Tensor:
    """Strided view of ``inner`` inside a contiguous copy of ``outer`` stored from ``base``."""
    first, _ = span(outer, inner)
    return data.as_strided(box_shape(inner), contiguous_strides(box_shape(outer)),
                           data.storage_offset() + base + first)


Fetch = Callable[[int, int], "torch.Tensor"]
"""``fetch(lo, hi)``: elements ``[lo, hi)`` of a source region's flat data, as a 1-D tensor."""


def copy_overlap(dst: torch.Tensor, dst_box: Box, dst_flat: tuple[int, int],
                 src_box: Box, src_flat: tuple[int, int], fetch: Fetch) -> int:
    """Copy the elements the source region shares with the destination region into ``dst`` (the
    destination's 1-D data). Fetches only the source elements spanning each overlap. Returns the
    number of elements copied."""
    if intersect(dst_box, src_box) is None:
        return 0
    copied = 0
    dst_parts = region_boxes(dst_box, dst_flat)
    for sb, so in region_boxes(src_box, src_flat):
        for tb, to in dst_parts:
            common = intersect(sb, tb)
            if common is None:
                continue
            p, q = span(sb, common)
            src = fetch(so + p, so + q)
            src_view = src.as_strided(box_shape(common), contiguous_strides(box_shape(sb)),
                                      src.storage_offset())
            _view(dst, tb, common, to).copy_(src_view)
            copied += numel(box_shape(common))
    return copied
