"""Benchmark: what opening a token corpus holds in one process, by the document count.

Every rank opens every training source (`mscale.data.blend.build_splits`). A Megatron corpus
records each document's start in its ``.idx``; the engine keeps only each shard's counts and
reads the starts again from the one index that holds the held-out cut
(`TokenDataset.next_document_start`). The reference is what it did before, in the same process:
every document start of every shard held at once (`TokenDataset.document_starts`, 8 bytes a
document). Shards are written with `IndexedWriter` (one token per document: the index is what
is measured, not the tokens), then each variant runs in a fresh process: ``build_splits`` of the
folder at ``eval_fraction`` 0.01, kept and peak Python-heap bytes by ``tracemalloc`` (numpy's
arrays are traced), and wall time. Not a test.

    .venv/bin/python bench/bench_open.py                       # 4M documents in 16 shards
    .venv/bin/python bench/bench_open.py --documents 1000000 --shards 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, documents: int, shards: int) -> None:
    """A prefix folder of ``shards`` Megatron shards, ``documents`` one-token documents."""
    from mscale.data.indexed import IndexedWriter

    rng = np.random.default_rng(0)
    for i, n in enumerate(np.diff(np.linspace(0, documents, shards + 1).astype(np.int64))):
        with IndexedWriter(str(folder / f"shard-{i:05d}"), "uint16") as w:
            w.add_documents(rng.integers(1, 1000, int(n), dtype=np.uint16),
                            np.ones(int(n), dtype=np.int64))


def measure(folder: str, variant: str) -> dict:
    """One variant in this process: kept and peak traced bytes of opening and splitting."""
    from mscale.config.training import DataConfig
    from mscale.data.blend import build_splits

    cfg = DataConfig(kind="tokens", path=folder, eval_fraction=0.01)
    tracemalloc.start()
    t0 = time.perf_counter()
    train, _ = build_splits(cfg, seq_len=8, seed=0, vocab=1000)
    held = [p.dataset.document_starts() for p in train.parts] if variant == "all-starts" else []
    wall = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    docs = sum(p.dataset.documents for p in train.parts)
    assert not held or sum(h.size - 1 for h in held) == docs
    return {"variant": variant, "documents": docs, "kept_mb": kept / 1e6, "peak_mb": peak / 1e6,
            "open_s": wall}


def run(folder: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", folder, variant],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--documents", type=int, default=4_000_000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp), args.documents, args.shards)
        rows = [run(tmp, v) for v in ("all-starts", "counts", "all-starts", "counts")]
    print(f"{args.documents:,} documents in {args.shards} shards, build_splits at "
          f"eval_fraction 0.01, fresh process each:")
    for r in rows:
        print(f"  {r['variant']:<11} kept {r['kept_mb']:8.1f} MB   peak {r['peak_mb']:8.1f} MB"
              f"   {r['open_s']:.2f} s")
    ref = [r for r in rows if r["variant"] == "all-starts"][-1]
    new = [r for r in rows if r["variant"] == "counts"][-1]
    print(f"kept: {ref['kept_mb'] / max(new['kept_mb'], 1e-9):.0f}x less; "
          f"peak: {ref['peak_mb'] / new['peak_mb']:.1f}x less "
          f"({ref['kept_mb'] / ref['documents'] * 1e6:.1f} B a document held before)")


if __name__ == "__main__":
    main()
