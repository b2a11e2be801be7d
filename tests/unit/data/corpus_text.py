"""Text corpora for the tests of `mscale data prepare` and its encoder (test_prepare*.py,
test_encode.py), and what the shards they give hold. The tokenizer they are encoded with is the
``tokenizer`` fixture (conftest.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from mscale.data.datasets import open_dataset
from mscale.data.tokenizer import load_tokenizer


WORDS = ("the model trains on tokens while every rank waits for the slowest link and a "
         "checkpoint lands before the node fails again data parallel pipeline tensor").split()


def text(seed: int, n: int = 40) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n))) + "."


def docs_of(out: Path) -> list[np.ndarray]:
    ds = open_dataset(str(out))
    tokens = ds.read(0, ds.num_tokens)
    return [tokens[a:b] for a, b in zip(ds.document_starts()[:-1], ds.document_starts()[1:])]


def decoded(out: Path, tokenizer: str) -> list[str]:
    tok = load_tokenizer(tokenizer)
    docs = docs_of(out)
    assert all(d[-1] == 0 for d in docs)  # every document ends with EOD
    return [tok.decode(d[:-1].tolist()) for d in docs]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
