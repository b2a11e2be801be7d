import math

import numpy as np

from mscale.data import stats
from mscale.data.datasets import open_dataset
from mscale.data.indexed import IndexedWriter


def _dataset(tmp_path, tokens):
    with IndexedWriter(str(tmp_path / "d"), np.uint16) as w:
        w.add_document(np.asarray(tokens))
    return open_dataset(str(tmp_path / "d"))


def test_unigram_entropy_is_that_of_the_token_frequencies(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "CHUNK", 7)  # several chunks, the last one short
    ds = _dataset(tmp_path, [0, 1] * 10 + [2, 3, 4, 5] * 5)  # 40 tokens: 1/4 each of 0,1; 1/8 others
    nats, counted = stats.unigram_entropy(ds)
    assert counted == 40
    assert math.isclose(nats, 2 * 0.25 * math.log(4) + 4 * 0.125 * math.log(8))


def test_a_large_dataset_is_sampled_in_chunks_that_do_not_overlap(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "CHUNK", 10)
    ds = _dataset(tmp_path, list(range(1000)))  # every token once: entropy ln(counted)
    nats, counted = stats.unigram_entropy(ds, max_tokens=100)
    assert counted == 100 and math.isclose(nats, math.log(100))
