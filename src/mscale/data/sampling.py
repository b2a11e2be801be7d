"""Which tokens global sample k is: pure index maths, vectorised with numpy, no loader state.

Global index k → (source, j-th draw of that source) by a fixed proportional interleave
(:class:`Blend`) → (epoch, sample of that source) by a keyed permutation per epoch
(:class:`Order`) → a token span of seq_len+1 tokens packed across document boundaries
(:class:`PackedSamples`). Every step is a function of (k, seed, sizes, weights), so every rank
and every parallel layout computes the same global batch and a resumed run needs only the
number of samples consumed. No torch here (the launcher imports it) and no Python ``hash()`` or
global RNG: the same inputs give the same outputs in any process.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from mscale.errors import MscaleError

ROUNDS = 6
"""Feistel rounds. Luby–Rackoff: 4 make a strong pseudo-random permutation from a random round
function; ours is a fixed mixer and small n gives 1-bit halves, so two spare rounds buy margin
for ~10 vector ops each."""
BLOCK = 1 << 16
"""Blend block: each source's share is rounded to c/BLOCK (error < 1/65,536, so a 0.1 % source
is within ~1.5 % of its weight, a 1 % source within ~0.15 %), while the layout table stays
~400 KB and builds once in ~50 ms for a handful of sources."""
SOURCES_FIELD = "training.data.sources"
EVAL_FIELD = "training.data.eval_fraction"

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ORDER_DOMAIN = np.uint64(0x6F72646572)  # "order": keys of Order differ from any raw key


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose every output bit depends on every
    input bit. Wrapping multiplication is the point, so overflow warnings are silenced."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _S30)
        x = x * _C1
        x = x ^ (x >> _S27)
        x = x * _C2
        return x ^ (x >> _S31)


def _u64(key: int | np.ndarray) -> np.ndarray:
    """A key as uint64 (Python ints of any sign or size reduced modulo 2^64)."""
    if isinstance(key, (int, np.integer)):
        return np.asarray(int(key) & _M64, dtype=np.uint64)
    return np.asarray(key).astype(np.uint64)


def _as_index(index: np.ndarray | int, name: str = "index") -> np.ndarray:
    """Non-negative integer indices as int64 (any integer dtype or Python int accepted)."""
    arr = np.asarray(index)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise IndexError(f"{name} must be >= 0, got {arr.min()}")
    return arr


def _feistel(x: np.ndarray, round_keys: list[np.ndarray], half: int) -> np.ndarray:
    """One pass of the balanced Feistel network over 2·half bits: a bijection of [0, 4^half)."""
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    left, right = x >> shift, x & mask
    with np.errstate(over="ignore"):
        for rk in round_keys:
            left, right = right, left ^ (_mix(right ^ rk) & mask)
    return (left << shift) | right


def permute(index: np.ndarray, n: int, key: int | np.ndarray) -> np.ndarray:
    """Position of each ``index`` under a keyed pseudo-random bijection of [0, n).

    Why a cipher and not ``rng.permutation(n)``: a 1T-token corpus at seq 4096 has 244M
    samples, a table per epoch is GBs on every rank; the Feistel network is evaluated pointwise
    in O(1) memory and is the same everywhere. It runs over the smallest even bit width with
    4^half ≥ n (< 4n values), and cycle-walks values that land outside [0, n) back through it
    (a bijection's cycle from an in-range value returns to one), so on average < 4 passes,
    looping only over the elements still out of range. ``key`` may be an array broadcast
    against ``index`` (per-element keys, e.g. one per epoch).
    """
    if not 1 <= n < 1 << 63:
        raise ValueError(f"permute needs 1 <= n < 2^63, got n={n}")
    idx = _as_index(index)
    if idx.size and idx.max() >= n:
        raise IndexError(f"index {idx.max()} out of range for n={n}")
    if n == 1:
        return np.zeros_like(idx)
    half = ((n - 1).bit_length() + 1) // 2
    flat = idx.ravel().astype(np.uint64)
    keys = np.broadcast_to(_u64(key), idx.shape).ravel()
    scalar = keys.size and np.all(keys == keys[0])
    base = keys[:1] if scalar else keys
    with np.errstate(over="ignore"):
        round_keys = [_mix(base + _GOLDEN * np.uint64(r + 1)) for r in range(ROUNDS)]
    out = _feistel(flat, round_keys, half)
    pending = np.flatnonzero(out >= np.uint64(n))
    while pending.size:
        rks = round_keys if scalar else [rk[pending] for rk in round_keys]
        out[pending] = _feistel(out[pending], rks, half)
        pending = pending[out[pending] >= np.uint64(n)]
    return out.astype(np.int64).reshape(idx.shape)


def order_key(seed: int, stream: int, epoch: np.ndarray) -> np.ndarray:
    """The permutation key of (seed, stream, epoch), one per element of ``epoch``: chained
    mixes, so nearby seeds, streams and epochs give unrelated keys."""
    with np.errstate(over="ignore"):
        base = _mix(_mix(_u64(seed) ^ _ORDER_DOMAIN) ^ _u64(stream))
        return _mix(base ^ np.asarray(epoch).astype(np.uint64))


class Order:
    """The sample order of one source of ``n`` samples: draw j is sample ``idx`` of epoch
    ``j // n``, a fresh permutation every epoch (or file order without ``shuffle``)."""

    def __init__(self, n: int, seed: int, stream: int, shuffle: bool = True):
        if n < 1:
            raise ValueError(f"a source needs at least one sample, got n={n}")
        self.n, self.seed, self.stream, self.shuffle = n, seed, stream, shuffle

    def at(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, sample index) of each draw ``j``."""
        j = _as_index(j, "draw")
        epoch, within = np.divmod(j, self.n)
        if not self.shuffle:
            return epoch, within
        return epoch, permute(within, self.n, order_key(self.seed, self.stream, epoch))


def _check_weights(weights: Sequence[float]) -> list[float]:
    """Weights as floats, each finite and > 0 (a zero source is a config mistake: drop it)."""
    if not len(weights):
        raise MscaleError("no data sources to blend", field=SOURCES_FIELD,
                          fix="list at least one source with a positive weight")
    out = []
    for i, w in enumerate(weights):
        w = float(w)
        if not (math.isfinite(w) and w > 0):
            raise MscaleError(f"weight {w} is not a positive finite number",
                              field=f"{SOURCES_FIELD}[{i}].weight",
                              fix="give every source a weight > 0, or remove the source")
        out.append(w)
    return out


def block_counts(weights: Sequence[float], block: int = BLOCK) -> list[int]:
    """Each source's draws per block: its largest-remainder share of ``block``, at least 1.

    Largest remainder (Hamilton) keeps every count within 1 of weight·block while summing to
    exactly ``block``; rounding each share alone would not sum to it. A source below
    1/block still gets 1, taken from the sources most over their quota. ``math.fsum`` makes the
    normalisation exact and order independent, so every process gets the same counts.
    """
    w = _check_weights(weights)
    if len(w) > block:
        raise MscaleError(f"{len(w)} sources exceed the blend block of {block}",
                          field=SOURCES_FIELD, fix=f"blend at most {block} sources")
    total = math.fsum(w)
    quota = [x / total * block for x in w]
    counts = [max(1, math.floor(q)) for q in quota]
    by_remainder = sorted(range(len(w)), key=lambda i: (counts[i] - quota[i], i))
    for i in by_remainder[: max(0, block - sum(counts))]:
        counts[i] += 1
    while sum(counts) > block:  # only after raising tiny sources to 1
        over = [i for i in range(len(w)) if counts[i] > 1]
        counts[max(over, key=lambda i: (counts[i] - quota[i], -i))] -= 1
    return counts


@lru_cache(maxsize=16)
def _layout(counts: tuple[int, ...], block: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy interleave of one block: position p goes to the source furthest below
    its share, ties to the lower index. Deficits are compared as integers (c_i·(p+1) −
    block·count_i), so the table is exact everywhere. Returns (source, rank among that source's
    positions). A pick never overshoots a share by 1 or more, so each source ends at exactly c_i
    and any prefix is within max(1, S−1) of c_i/block · k."""
    table = np.empty(block, dtype=np.int32)
    rank = np.empty(block, dtype=np.int64)
    seen = [0] * len(counts)
    for p in range(block):
        t, best, top = p + 1, 0, None
        for i, c in enumerate(counts):
            d = c * t - block * seen[i]
            if top is None or d > top:
                best, top = i, d
        table[p], rank[p] = best, seen[best]
        seen[best] += 1
    table.flags.writeable = rank.flags.writeable = False
    return table, rank


class Blend:
    """Global index k → (source, j-th draw of that source), exactly proportional over blocks.

    Each block of ``block`` consecutive indices gives source i exactly ``counts[i]`` draws, laid
    out by the greedy interleave, so every prefix holds each source within max(1, S−1) draws
    of its share (under 1 in practice): no sampling noise in the mix. The in-block order is
    deliberately not shuffled (so there is no seed): shuffling would trade that bound for
    √batch noise, and each source's own order is already a seeded permutation (:class:`Order`).
    """

    def __init__(self, weights: Sequence[float], *, block: int = BLOCK):
        self.block = block
        self.counts = np.asarray(block_counts(weights, block), dtype=np.int64)
        self.table, self.rank = _layout(tuple(int(c) for c in self.counts), block)

    @property
    def shares(self) -> np.ndarray:
        """The weights actually served: counts / block."""
        return self.counts / self.block

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw j of that source) for each global index ``k``."""
        k = _as_index(k, "k")
        blk, pos = np.divmod(k, self.block)
        source = self.table[pos].astype(np.int64)
        return source, blk * self.counts[source] + self.rank[pos]


class PackedSamples:
    """The samples of tokens [start, stop): sample i is tokens [start + i·s, start + i·s + s + 1),
    packed across document boundaries as Megatron-LM does; neighbours share one token (the last
    label of one is the first input of the next), as TokenFile always has."""

    def __init__(self, num_tokens: int, seq_len: int, start: int = 0, stop: int | None = None):
        stop = num_tokens if stop is None else stop
        if seq_len < 1 or not 0 <= start <= stop <= num_tokens:
            raise ValueError(f"bad range [{start}, {stop}) of {num_tokens} tokens, "
                             f"seq_len {seq_len}")
        self.start, self.stop, self.seq_len = start, stop, seq_len
        self.count = max(0, (stop - start - 1) // seq_len)
        if self.count < 1:
            raise MscaleError(f"tokens [{start}, {stop}) hold {stop - start} tokens, fewer than "
                              f"one sequence of seq_len+1 = {seq_len + 1} tokens",
                              fix="use more data or a shorter seq_len")

    def span(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first token, one past the last token) of each sample ``i``."""
        i = _as_index(i, "sample")
        if i.size and i.max() >= self.count:
            raise IndexError(f"sample {i.max()} out of range: {self.count} samples")
        starts = self.start + i * self.seq_len
        return starts, starts + self.seq_len + 1


def split_documents(num_tokens: int, eval_fraction: float, seq_len: int = 1,
                    next_document_start: Callable[[int], int] | None = None,
                    ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(train, eval) token ranges: the eval range is the tail from the first document start at or
    after (1 − f)·num_tokens (the token position itself without document boundaries), so no
    document is in both and the held-out loss is on unseen documents. ``next_document_start``
    (`TokenDataset.next_document_start`) gives the first document start at or after a token, or
    ``num_tokens``; None for a source without documents. f = 0: empty eval range. Either side
    without one sample of seq_len+1 tokens is an error naming ``training.data.eval_fraction``
    (the caller attaches the file)."""
    f = float(eval_fraction)
    if not (math.isfinite(f) and 0 <= f < 1):
        raise MscaleError(f"eval_fraction {eval_fraction} is not in [0, 1)", field=EVAL_FIELD,
                          fix="hold out a fraction such as 0.01")
    if f == 0:
        return (0, num_tokens), (num_tokens, num_tokens)
    target = num_tokens - math.floor(f * num_tokens)
    cut = target if next_document_start is None else next_document_start(target)
    need = seq_len + 1
    if num_tokens < 2 * need:  # no fraction helps: name the size, not the fraction
        raise MscaleError(f"holds {num_tokens} tokens, too few to split into a training and a "
                          f"held-out sample of seq_len+1 = {need} tokens each", field=EVAL_FIELD,
                          fix="give it more data, or name held-out sources with eval_sources")
    if cut >= num_tokens and next_document_start is not None \
            and next_document_start(1) >= num_tokens:
        raise MscaleError("is one document: the held-out split is cut at a document boundary, "
                          "so there is none", field=EVAL_FIELD,
                          fix="name held-out sources with eval_sources, or prepare the text as "
                              "several documents")
    for name, size, fix in (("eval", num_tokens - cut, "raise eval_fraction (the last document "
                             "may be long: the cut is at a document boundary)"),
                            ("train", cut, "lower eval_fraction")):
        if size < need:
            raise MscaleError(f"eval_fraction {f} leaves the {name} split {size} tokens, fewer "
                              f"than one sample of seq_len+1 = {need}", field=EVAL_FIELD, fix=fix)
    return (0, cut), (cut, num_tokens)


class Mixture:
    """One split's sample order: global index k → (source, sample of that source), a
    :class:`Blend` of the sources then each source's :class:`Order` (stream = source index).
    The train and eval mixtures should get different seeds; that is the caller's choice."""

    def __init__(self, counts: Sequence[int], weights: Sequence[float], seed: int,
                 shuffle: bool = True, *, block: int = BLOCK):
        if len(counts) != len(weights):
            raise ValueError(f"{len(counts)} sample counts for {len(weights)} weights")
        for i, n in enumerate(counts):
            if int(n) < 1:
                raise MscaleError(f"source {i} holds no samples", field=f"{SOURCES_FIELD}[{i}]",
                                  fix="remove the source or give it more data")
        self.counts = np.asarray(counts, dtype=np.int64)
        self.blend = Blend(weights, block=block)
        self.orders = [Order(int(n), seed, i, shuffle) for i, n in enumerate(counts)]

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index within that source) for each global index ``k``."""
        source, j = self.blend.locate(k)
        sample = np.empty_like(j)
        for i, order in enumerate(self.orders):
            mine = source == i
            if mine.any():
                sample[mine] = order.at(j[mine])[1]
        return source, sample

    def epochs(self, k: np.ndarray) -> np.ndarray:
        """Epoch of its source each global index ``k`` is in (0 first), for "source X entered
        epoch 2" lines."""
        source, j = self.blend.locate(k)
        return j // self.counts[source]
