"""Fixtures shared by the data tests."""

from __future__ import annotations

import pytest

from mscale.data.tokenizer import train_tokenizer

from tests.unit.data.corpus_text import text


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> str:
    """A 300-id byte-level BPE trained on a few KB (<|endoftext|> = 0)."""
    d = tmp_path_factory.mktemp("tokenizer")
    (d / "corpus.txt").write_text("\n".join(text(i, 80) for i in range(60)))
    out = d / "tokenizer.json"
    train_tokenizer([str(d / "corpus.txt")], 300, str(out))
    return str(out)
