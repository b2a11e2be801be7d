"""Figures of a token dataset that say what a loss means.

The unigram entropy is the loss of the best model that ignores context (it predicts every token
with the data's own token frequencies): a language model whose held-out loss is not below it
has learned nothing from the text around a token. In nats, as the training loss.
"""

from __future__ import annotations

import math

import numpy as np

from mscale.data.indexed import TokenDataset

CHUNK = 1 << 20
"""Tokens read at a time."""


def unigram_entropy(ds: TokenDataset, max_tokens: int = 1 << 26) -> tuple[float, int]:
    """(entropy in nats per token, tokens counted). A dataset larger than ``max_tokens`` is
    sampled in evenly spaced chunks of `CHUNK` tokens, so a corpus of any size costs the same."""
    n = ds.num_tokens
    if n <= max_tokens:  # all of it
        starts = range(0, n, CHUNK)
    else:  # evenly spaced chunks that do not overlap
        starts = np.linspace(0, n - CHUNK, math.ceil(max_tokens / CHUNK)).astype(np.int64)
    counts = np.zeros(0, np.int64)
    counted = 0
    for start in (int(s) for s in starts):
        tokens = ds.read(start, min(n, start + CHUNK))
        c = np.bincount(tokens)
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
        counted += len(tokens)
    p = counts[counts > 0] / counted
    return float(-(p * np.log(p)).sum()), counted
