"""Memory per GPU: model states under ZeRO and activations by the Korthikanti formulas.

Every function works on plain numbers and on numpy arrays alike, so the search evaluates all
candidate layouts at once with the same code that evaluates one.
"""

from __future__ import annotations

import numpy as np

from mscale.planner.constants import STATE_BYTES

RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}
"""Recompute modes as integers, for vectorised evaluation."""


def activation_bytes_per_layer(s, b, h, a, t, sp, recompute):
    """Bytes one block keeps for backward, per micro-batch (Korthikanti et al., arXiv 2205.05198;
    docs/references.md), for s sequence length, b micro-batch, h hidden, a heads, t TP size.

    - no recompute, TP only: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (t = 1: ``s·b·h·(34 + 5·a·s/h)``)
    - no recompute, TP + SP: ``s·b·h·(34 + 5·a·s/h)/t``
    - selective: the ``5·a·s/h`` attention-score term is recomputed, not kept:
      ``s·b·h·(10 + 24/t)`` without SP, ``34·s·b·h/t`` with SP
    - full: only the block input, ``2·s·b·h`` (``/t`` when SP shards it)

    The coefficients assume a GPT block (4h MLP, multi-head attention) with bf16 activations;
    for SwiGLU/GQA models they are an approximation of the same order.
    ``recompute`` is a code from RECOMPUTE_CODES.
    """
    sbh = s * b * h
    score = 5 * a * s / h
    sp = np.asarray(sp, dtype=bool) & (np.asarray(t) > 1)
    none = np.where(sp, sbh * (34 + score) / t, sbh * (10 + 24 / t + score / t))
    selective = np.where(sp, 34 * sbh / t, sbh * (10 + 24 / t))
    full = np.where(sp, 2 * sbh / t, 2 * sbh)
    return np.select([recompute == 0, recompute == 1], [none, selective], full)


def in_flight_micro_batches(p, v, m):
    """Micro-batches whose activations the first pipeline stage holds at its peak.

    1F1B: min(p, m) (docs/references.md: about L layers' worth in total). Interleaved 1F1B holds
    ``p·(1 + (p−1)/(p·v))``: Megatron-LM's ``interleaved_schedule_memory_penalty``
    (megatron/training/theoretical_memory_usage.py) multiplies the 1F1B figure by
    ``1 + (p−1)/(p·v)``, after Korthikanti et al. (arXiv 2205.05198) §4.2.3. The penalty is largest
    at v = 2 and falls towards 1 + (p−1)/L at one block per virtual stage, so memory does not
    penalise deep interleaving; its cost is time (comm.pp_critical_transfers). No pipeline: one
    micro-batch at a time.
    """
    p, v, m = np.asarray(p), np.asarray(v), np.asarray(m)
    one_f_one_b = np.minimum(p, m).astype(float)
    interleaved = p * (1 + (p - 1) / (p * v))
    return np.where(p == 1, 1.0, np.where(v > 1, interleaved, one_f_one_b))


def state_bytes_per_param(precision: str, dp, zero):
    """Bytes of model state per parameter on one GPU (docs/references.md): weights, gradients, optimizer.

    Returns a dict of arrays. ZeRO-1 divides the optimizer state by DP; ZeRO-2 the gradients too.
    """
    b = STATE_BYTES[precision]
    dp, zero = np.asarray(dp), np.asarray(zero)
    return {
        "weights": np.full(np.shape(dp), float(b["weight"])),
        "gradients": np.where(zero >= 2, b["grad"] / dp, float(b["grad"])),
        "optimizer": np.where(zero >= 1, b["optimizer"] / dp, float(b["optimizer"])),
    }


def activation_total(per_layer, layers, in_flight):
    """Bytes of activations on one rank: its blocks × micro-batches in flight."""
    return per_layer * layers * in_flight

