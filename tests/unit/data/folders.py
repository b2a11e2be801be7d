"""Token folders for tests, as `mscale data prepare` writes them."""

import json

import numpy as np

from mscale.data.indexed import IndexedWriter


def prepared(folder, docs, **extra):
    """A folder as `mscale data prepare` writes it (IndexedWriter + manifest.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    with IndexedWriter(str(folder / "shard-00000"), np.uint16) as w:
        for d in docs:
            w.add_document(np.asarray(d))
        info = w.close()
    (folder / "manifest.json").write_text(json.dumps({
        "format": "mscale-tokens", "version": 1, "tokenizer": "t.json", "vocab_size": 300,
        "eod_id": 0, "dtype": "uint16", "tokens": info["tokens"],
        "documents": info["documents"], "shards": [{**info, "prefix": "shard-00000"}], **extra}))
