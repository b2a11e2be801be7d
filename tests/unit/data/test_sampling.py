"""data/sampling.py: the keyed permutation, per-source epochs, the proportional blend, packing,
the held-out split and the mixture that chains them (all pure index maths)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mscale.data.sampling import (BLOCK, Blend, Mixture, Order, PackedSamples, block_counts,
                                  permute, split_documents)
from mscale.errors import MscaleError

SIZES = [1, 2, 3, 7, 1000, 2**16, 2**16 + 1, 99_991]
KEYS = [0, 1, 12_345, -1, 2**70 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_permute_is_a_bijection(n):
    for key in KEYS if n <= 1000 else KEYS[::2]:
        out = permute(np.arange(n), n, key)
        assert out.dtype == np.int64
        assert np.array_equal(np.sort(out), np.arange(n)), key


def test_permute_is_deterministic_and_pinned():
    """Changing the cipher changes the data order of every run, resumed ones included."""
    a = permute(np.arange(10), 1000, 42)
    assert np.array_equal(a, permute(np.arange(10), 1000, 42))
    assert a.tolist() == [899, 754, 631, 534, 148, 897, 634, 156, 560, 715]
    assert np.array_equal(permute(np.array([[3, 1], [4, 1]]), 7, 5),
                          permute(np.arange(7), 7, 5)[[[3, 1], [4, 1]]])


def test_permute_keys_give_different_orders():
    n = 100_000
    base = permute(np.arange(n), n, 0)
    for key in (1, 2**63):
        assert np.mean(permute(np.arange(n), n, key) == base) < 1e-3


def test_permute_looks_shuffled():
    n = 100_000
    i = np.arange(n)
    p = permute(i, n, 7)
    assert np.sum(p == i) <= 20  # a random permutation has 1 fixed point on average
    assert abs(np.corrcoef(i, p)[0, 1]) < 0.02
    gap = np.mean(np.abs(np.diff(p))) / n  # neighbours land 1/3 of the range apart if random
    assert abs(gap - 1 / 3) < 0.01
    assert abs(np.mean(p[: n // 2] < n // 2) - 0.5) < 0.01


def test_permute_array_key_is_per_element():
    idx = np.arange(50) % 10
    keys = np.arange(50) // 10
    out = permute(idx, 10, keys)
    for key in range(5):
        assert np.array_equal(out[keys == key], permute(np.arange(10), 10, key))


def test_permute_pointwise_on_a_huge_domain():
    n = 10**12
    idx = np.concatenate([[0, 1, n - 1], np.random.default_rng(0).integers(0, n, 20_000)])
    out = permute(idx, n, 3)
    assert out.min() >= 0 and out.max() < n
    assert len(np.unique(out)) == len(np.unique(idx))
    assert np.array_equal(out[:3], [permute(np.array([x]), n, 3)[0] for x in idx[:3]])


def test_permute_refuses_bad_input():
    with pytest.raises(ValueError):
        permute(np.arange(0), 0, 1)
    with pytest.raises(IndexError):
        permute(np.array([5]), 5, 1)
    with pytest.raises(IndexError):
        permute(np.array([-1]), 5, 1)
    with pytest.raises(TypeError):
        permute(np.array([0.5]), 5, 1)
    assert permute(np.zeros(4, dtype=np.int32), 1, 9).tolist() == [0, 0, 0, 0]


def test_order_epochs_are_distinct_permutations():
    n = 1000
    epoch, idx = Order(n, seed=1, stream=0).at(np.arange(3 * n))
    assert np.array_equal(epoch, np.repeat([0, 1, 2], n))
    per_epoch = idx.reshape(3, n)
    for row in per_epoch:
        assert np.array_equal(np.sort(row), np.arange(n))
    assert np.mean(per_epoch[0] == per_epoch[1]) < 0.01
    assert np.mean(per_epoch[1] == per_epoch[2]) < 0.01


def test_order_seed_stream_and_no_shuffle():
    j = np.arange(500)
    a = Order(500, seed=1, stream=0).at(j)[1]
    assert np.array_equal(a, Order(500, seed=1, stream=0).at(j)[1])
    assert np.mean(a == Order(500, seed=2, stream=0).at(j)[1]) < 0.05
    assert np.mean(a == Order(500, seed=1, stream=1).at(j)[1]) < 0.05
    epoch, idx = Order(7, seed=1, stream=0, shuffle=False).at(np.arange(20))
    assert idx.tolist() == [i % 7 for i in range(20)]
    assert epoch.tolist() == [i // 7 for i in range(20)]


def test_block_counts_largest_remainder():
    counts = block_counts([0.5, 0.3, 0.2])
    assert sum(counts) == BLOCK
    assert all(abs(c - w * BLOCK) < 1 for c, w in zip(counts, [0.5, 0.3, 0.2]))
    assert block_counts([1, 1, 1], 10) == [4, 3, 3]  # ties to the lower index
    assert block_counts([2, 6], 8) == [2, 6]  # normalised
    tiny = block_counts([1e-9, 1, 1], 10)
    assert tiny[0] == 1 and sum(tiny) == 10


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_blend_weight_errors_name_the_field(bad):
    with pytest.raises(MscaleError) as e:
        Blend([1.0, 2.0, bad])
    assert e.value.field == "training.data.sources[2].weight"


def test_blend_refuses_no_sources_and_too_many():
    with pytest.raises(MscaleError) as e:
        Blend([])
    assert e.value.field == "training.data.sources"
    with pytest.raises(MscaleError):
        Blend([1.0] * 5, block=4)


def blend_case() -> tuple[Blend, int]:
    return Blend([0.37, 0.05, 0.01, 0.57], block=1000), 10 * 1000


def test_blend_exact_per_block():
    blend, total = blend_case()
    source, _ = blend.locate(np.arange(total))
    for b in range(10):
        per_block = np.bincount(source[b * 1000:(b + 1) * 1000], minlength=4)
        assert np.array_equal(per_block, blend.counts)
    assert blend.counts.tolist() == [370, 50, 10, 570]
    assert np.allclose(blend.shares, [0.37, 0.05, 0.01, 0.57])


def test_blend_interleaves_evenly():
    """Over every prefix k, source i has drawn within a constant of share_i·k: overshoot < 1
    (a pick never overshoots), deficit < S − 1 (the deficits sum to 0)."""
    blend, total = blend_case()
    source, _ = blend.locate(np.arange(total))
    k = np.arange(1, total + 1)
    drawn = np.cumsum(source[None, :] == np.arange(4)[:, None], axis=1)
    dev = drawn - blend.shares[:, None] * k
    assert dev.max() < 1 and dev.min() > -3
    assert np.abs(dev).max() < 1.5  # this case, tighter than the bound


def test_blend_locate_is_a_bijection_onto_draw_sequences():
    blend, total = blend_case()
    k = np.arange(total)
    source, j = blend.locate(k)
    for i in range(4):
        assert np.array_equal(j[source == i], np.arange(10 * blend.counts[i]))  # in order, no gap
    s2, j2 = blend.locate(k[::-1].copy())
    assert np.array_equal(s2[::-1], source) and np.array_equal(j2[::-1], j)


def test_blend_default_block_and_one_source():
    blend = Blend([0.5, 0.3, 0.2])
    source, j = blend.locate(np.arange(3 * BLOCK, 4 * BLOCK))
    assert np.array_equal(np.bincount(source), blend.counts)
    assert np.array_equal(j[source == 0], np.arange(3 * blend.counts[0], 4 * blend.counts[0]))
    source, j = Blend([3.0]).locate(np.arange(10**6, 10**6 + 100))
    assert not source.any() and np.array_equal(j, np.arange(10**6, 10**6 + 100))


def test_packed_samples_spans_overlap_by_one():
    packed = PackedSamples(100, seq_len=8, start=10, stop=60)
    assert packed.count == (50 - 1) // 8 == 6
    starts, stops = packed.span(np.arange(packed.count))
    assert starts.tolist() == [10, 18, 26, 34, 42, 50]
    assert np.array_equal(stops - starts, np.full(6, 9))
    assert stops[-1] <= 60 and np.array_equal(stops[:-1] - 1, starts[1:])
    assert PackedSamples(9, seq_len=8).count == 1
    with pytest.raises(IndexError):
        packed.span(np.array([6]))


def test_packed_samples_refuses_less_than_one_sequence():
    with pytest.raises(MscaleError, match=r"\[0, 8\).*seq_len\+1 = 9"):
        PackedSamples(8, seq_len=8)
    with pytest.raises(MscaleError, match=r"\[90, 100\)"):
        PackedSamples(100, seq_len=16, start=90)


def starts_at(offsets, num_tokens):
    """`TokenDataset.next_document_start` over a list of document starts."""
    ends = np.append(np.asarray(offsets, dtype=np.int64), num_tokens)
    return lambda pos: int(ends[np.searchsorted(ends, pos, side="left")])


def test_split_documents_cuts_at_a_document_start():
    offsets = np.array([0, 120, 300, 640, 870, 930])
    train, held = split_documents(1000, 0.2, 8, starts_at(offsets, 1000))  # (1 - f)·N = 800
    assert train == (0, 870) and held == (870, 1000)
    for lo, hi in zip(offsets, list(offsets[1:]) + [1000]):  # no document in both
        assert hi <= train[1] or lo >= held[0]


def test_split_documents_without_offsets_and_f_zero():
    assert split_documents(1000, 0.1) == ((0, 900), (900, 1000))
    assert split_documents(1000, 0.0, 1, starts_at([0, 500], 1000)) == ((0, 1000), (1000, 1000))


def test_split_documents_errors_name_eval_fraction():
    with pytest.raises(MscaleError, match="eval split 0 tokens") as e:
        split_documents(1000, 0.1, 8, starts_at([0, 100], 1000))  # one long last document
    assert e.value.field == "training.data.eval_fraction"
    with pytest.raises(MscaleError, match="train split"):
        split_documents(20, 0.9, seq_len=8)
    with pytest.raises(MscaleError) as e:
        split_documents(1000, 1.0)
    assert e.value.field == "training.data.eval_fraction"


def test_a_source_no_fraction_can_split_says_what_would_help():
    """A 7-token source at eval_fraction 0.5 was told to raise eval_fraction, already the
    maximum (helper-42's trial); so was a source of one document, which no fraction can cut."""
    with pytest.raises(MscaleError, match="holds 7 tokens, too few") as e:
        split_documents(7, 0.5, 8, starts_at([0], 7))
    assert "eval_sources" in e.value.fix and e.value.field == "training.data.eval_fraction"
    with pytest.raises(MscaleError, match="one document") as e:
        split_documents(1000, 0.1, 8, starts_at([0], 1000))
    assert "eval_sources" in e.value.fix


def test_mixture_end_to_end():
    counts, weights = [300, 40, 1000], [0.5, 0.25, 0.25]
    k = np.arange(8000)
    mix = Mixture(counts, weights, seed=11, block=400)
    source, sample = mix.locate(k)
    again = Mixture(counts, weights, seed=11, block=400).locate(k)
    assert np.array_equal(source, again[0]) and np.array_equal(sample, again[1])
    assert np.array_equal(np.bincount(source[:400]), [200, 100, 100])
    assert not np.array_equal(sample, Mixture(counts, weights, seed=12, block=400).locate(k)[1])
    for i, n in enumerate(counts):  # every source walks whole epochs of its samples
        mine = sample[source == i]
        full = len(mine) // n * n
        assert np.array_equal(np.sort(mine[:full].reshape(-1, n), axis=1),
                              np.tile(np.arange(n), (full // n, 1)))
    epochs = mix.epochs(k)
    assert epochs[source == 1].max() == 2000 // 40 - 1
    assert np.array_equal(epochs[source == 0], np.arange(4000) // 300)


def test_mixture_refuses_empty_sources():
    with pytest.raises(MscaleError) as e:
        Mixture([10, 0], [1, 1], seed=0)
    assert e.value.field == "training.data.sources[1]"
    with pytest.raises(ValueError):
        Mixture([10], [1, 1], seed=0)
