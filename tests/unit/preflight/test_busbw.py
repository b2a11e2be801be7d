"""The bus bandwidth of a collective on a group (preflight/busbw.py): nccl-tests' factors."""

from __future__ import annotations

from mscale.preflight.busbw import bus_factor


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("allreduce", 8) == 2 * 7 / 8
    assert bus_factor("allgather", 8) == 7 / 8
    assert bus_factor("reduce_scatter", 4) == 3 / 4
