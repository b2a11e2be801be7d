"""Index arithmetic of regions: flat ranges as boxes, and copies between any two tilings."""

from __future__ import annotations

import random

import pytest
import torch

from mscale.ckpt.slices import (box_shape, copy_overlap, flat_to_boxes, numel, region_boxes,
                                rows_box, span)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 6, 1, 3)])
def test_flat_ranges_are_contiguous_boxes_in_order(shape):
    idx = torch.arange(numel(shape)).view(shape)
    n = numel(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            parts = flat_to_boxes(shape, lo, hi)
            assert len(parts) <= 2 * len(shape) - 1
            got = []
            for box, off in parts:
                flat = idx[tuple(slice(a, b) for a, b in box)].reshape(-1)
                assert flat.tolist() == list(range(lo + off, lo + off + flat.numel()))
                got += flat.tolist()
            assert got == list(range(lo, hi))


def test_span_covers_the_inner_box():
    outer = ((2, 6), (0, 5))
    inner = ((3, 5), (1, 3))
    lo, hi = span(outer, inner)
    assert (lo, hi) == (1 * 5 + 1, 2 * 5 + 3)
    assert rows_box(((4, 8), (0, 5)), (6, 12)) == ((5, 7), (0, 5))


def _cuts(n: int, k: int, rng: random.Random) -> list[tuple[int, int]]:
    points = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
    edges = [0, *points, n]
    return list(zip(edges[:-1], edges[1:]))


def _tiling(shape, split_dim, parts, pieces, rng):
    """Regions like a TP split along ``split_dim`` cut into ZeRO flat pieces."""
    out = []
    step = shape[split_dim] // parts
    for t in range(parts):
        box = [(0, d) for d in shape]
        box[split_dim] = (t * step, (t + 1) * step)
        box = tuple(box)
        for flat in _cuts(numel(box_shape(box)), pieces, rng):
            out.append((box, flat))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_any_region_is_rebuilt_from_any_other_tiling(seed):
    rng = random.Random(seed)
    shape = (12, 8)
    g = torch.randn(shape)
    src = _tiling(shape, rng.choice([0, 1]), rng.choice([1, 2, 4]), rng.randint(1, 5), rng)
    dst = _tiling(shape, rng.choice([0, 1]), rng.choice([1, 2, 4]), rng.randint(1, 5), rng)
    for box, flat in dst:
        out = torch.full((flat[1] - flat[0],), float("nan"))
        copied = 0
        for sbox, sflat in src:
            data = g[tuple(slice(a, b) for a, b in sbox)].reshape(-1)[sflat[0]: sflat[1]]
            fetched = []

            def fetch(lo, hi, data=data):
                fetched.append(hi - lo)
                return data[lo:hi].clone()

            copied += copy_overlap(out, box, flat, sbox, sflat, fetch)
        want = g[tuple(slice(a, b) for a, b in box)].reshape(-1)[flat[0]: flat[1]]
        assert copied == out.numel()
        assert torch.equal(out, want)


def test_region_boxes_are_global():
    parts = region_boxes(((4, 8), (2, 6)), (3, 9))
    assert parts[0] == (((4, 5), (5, 6)), 0)
    assert sum(numel(box_shape(b)) for b, _ in parts) == 6
