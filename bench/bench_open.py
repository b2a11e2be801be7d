"""Benchmark: what opening a prepared token corpus reads and holds in one process.

Every rank opens every training source (`mscale.data.blend.build_splits`). A Megatron shard
records each document's start in its ``.idx`` (20 bytes a document). The engine opens a prepared
folder from its manifest and one listing, keeps each shard's counts, and reads one index: the
one the held-out cut falls in (`TokenDataset.next_document_start`). The reference is what it did
before, in the same script: every index read and checked at open (``check_indexes``, as `data
verify` still does) and every document start held (`TokenDataset.document_starts`, 8 bytes a
document). Shards are written by `IndexedWriter` with a manifest (one token per document: the
index is what is measured), then each variant runs in a fresh process: ``build_splits`` of the
folder at ``eval_fraction`` 0.01; index bytes parsed, kept and peak Python-heap bytes by
``tracemalloc`` (numpy's arrays are traced), and wall time. Not a test.

    .venv/bin/python bench/bench_open.py                       # 4M documents in 16 shards
    .venv/bin/python bench/bench_open.py --documents 1000000 --shards 4
"""

from __future__ import annotations

import argparse
import functools
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
    """A prepared folder: ``shards`` shards of ``documents`` one-token documents, a manifest."""
    from mscale.data.indexed import IndexedWriter

    rng, entries = np.random.default_rng(0), []
    for i, n in enumerate(np.diff(np.linspace(0, documents, shards + 1).astype(np.int64))):
        w = IndexedWriter(str(folder / f"shard-{i:05d}"), "uint16")
        w.add_documents(rng.integers(1, 1000, int(n), dtype=np.uint16),
                        np.ones(int(n), dtype=np.int64))
        entries.append(w.close())
    manifest = {"format": "mscale-tokens", "version": 1, "tokenizer": "none", "vocab_size": 1000,
                "eod_id": 0, "dtype": "uint16", "tokens": documents, "documents": documents,
                "shards": entries}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def measure(folder: str, variant: str) -> dict:
    """One variant in this process: index bytes parsed, kept and peak traced bytes of opening and
    splitting."""
    import mscale.data.blend as blend
    import mscale.data.indexed as indexed
    from mscale.config.training import DataConfig

    parsed, parse = [], indexed.parse_index
    indexed.parse_index = lambda idx, *a: parsed.append(len(idx)) or parse(idx, *a)
    if variant == "all-starts":
        blend.open_dataset = functools.partial(blend.open_dataset, check_indexes=True)
    cfg = DataConfig(kind="tokens", path=folder, eval_fraction=0.01)
    tracemalloc.start()
    t0 = time.perf_counter()
    train, _ = blend.build_splits(cfg, seq_len=8, seed=0, vocab=1000)
    index_bytes = sum(parsed)  # what opening read; holding the starts below reads them again
    held = [p.dataset.document_starts() for p in train.parts] if variant == "all-starts" else []
    wall = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    docs = sum(p.dataset.documents for p in train.parts)
    assert not held or sum(h.size - 1 for h in held) == docs
    return {"variant": variant, "documents": docs, "kept_mb": kept / 1e6, "peak_mb": peak / 1e6,
            "open_s": wall, "index_mb": index_bytes / 1e6}


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
        print(f"  {r['variant']:<11} index read {r['index_mb']:7.1f} MB   kept {r['kept_mb']:6.1f}"
              f" MB   peak {r['peak_mb']:6.1f} MB   {r['open_s']:.2f} s")
    ref = [r for r in rows if r["variant"] == "all-starts"][-1]
    new = [r for r in rows if r["variant"] == "counts"][-1]
    print(f"index read: {ref['index_mb'] / new['index_mb']:.0f}x less; "
          f"kept: {ref['kept_mb'] / max(new['kept_mb'], 1e-9):.0f}x less; "
          f"peak: {ref['peak_mb'] / new['peak_mb']:.1f}x less "
          f"({ref['kept_mb'] / ref['documents'] * 1e6:.1f} B a document held before)")


if __name__ == "__main__":
    main()
