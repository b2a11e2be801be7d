"""Activation and model-state bytes against hand values from docs/references.md."""

import pytest

from mscale.planner.memory import (activation_bytes_per_layer, in_flight_micro_batches,
                                   state_bytes_per_param)

S, B, H, A = 2048, 1, 12288, 96  # GPT-3: 5·a·s/h = 80
SBH = S * B * H


@pytest.mark.parametrize("t,sp,rec,coeff", [
    (1, False, 0, 34 + 80),            # no parallelism: s·b·h·(34 + 5as/h)
    (8, False, 0, 10 + 24 / 8 + 80 / 8),  # TP: s·b·h·(10 + 24/t + 5as/(ht))
    (8, True, 0, (34 + 80) / 8),       # TP + SP: s·b·h·(34 + 5as/h)/t
    (8, True, 1, 34 / 8),              # TP + SP + selective: 34·s·b·h/t
    (8, False, 1, 10 + 24 / 8),        # TP + selective: the score term is recomputed
    (8, False, 2, 2),                  # full recompute: the layer input, 2·s·b·h
    (8, True, 2, 2 / 8),               # ... sharded by SP
    (1, True, 0, 34 + 80),             # SP means nothing without TP
])
def test_activation_bytes_per_layer(t, sp, rec, coeff):
    assert float(activation_bytes_per_layer(S, B, H, A, t, sp, rec)) == pytest.approx(SBH * coeff)


def test_activation_scales_with_micro_batch():
    one = activation_bytes_per_layer(S, 1, H, A, 8, True, 1)
    assert float(activation_bytes_per_layer(S, 4, H, A, 8, True, 1)) == pytest.approx(4 * one)


def test_in_flight_micro_batches():
    assert float(in_flight_micro_batches(8, 1, 32)) == 8      # 1F1B: p in flight
    assert float(in_flight_micro_batches(8, 1, 4)) == 4       # never more than m
    assert float(in_flight_micro_batches(1, 1, 32)) == 1      # no pipeline
    assert float(in_flight_micro_batches(8, 6, 32)) == pytest.approx(8 * (1 + 7 / 48))
    # one block per virtual stage (96 blocks, p 3, v 32): 3 · (1 + 2/96) = 3.0625
    assert float(in_flight_micro_batches(3, 32, 3)) == pytest.approx(3.0625)
    # v = 2 keeps the most: 8 · (1 + 7/16) = 11.5 micro-batches' worth of a rank's blocks
    assert float(in_flight_micro_batches(8, 2, 32)) == pytest.approx(11.5)


@pytest.mark.parametrize("zero,expected", [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 8),
                                           (2, 2 + 4 / 8 + 12 / 8)])
def test_state_bytes_under_zero(zero, expected):
    per = state_bytes_per_param("bf16", 8, zero)
    assert sum(float(v) for v in per.values()) == pytest.approx(expected)


def test_fp32_has_no_master_copy():
    assert sum(float(v) for v in state_bytes_per_param("fp32", 1, 0).values()) == 16
