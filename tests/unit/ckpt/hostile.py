"""Helpers for the hostile-input tests: a small committed checkpoint, and manifest and shard index
edits that are re-signed (the manifest and the commit marker updated to the new sha256s), as an
operator with write access could."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from mscale.ckpt.manifest import COMMITTED, MANIFEST, index_name
from tests.unit.ckpt.helpers import global_state, plan, write_synthetic


def make_run(root: Path, steps=(5,), **layout) -> Path:
    """RUN/ckpt/step-NNNNNN for each step (latest names the last); returns RUN."""
    p = plan(**layout)
    tensors = global_state(p)
    for s in steps:
        write_synthetic(str(root / "ckpt" / f"step-{s:06d}"), p, tensors, step=s)
    return root


def run_with_plan(root: Path) -> Path:
    """ROOT/plan.yaml (dp 2) and ROOT/run with checkpoints at steps 2 and 5 (latest: 5), the
    run `ckpt convert` tests convert from; returns ROOT/run."""
    from mscale.config.base import dump_yaml

    (root / "plan.yaml").write_text(dump_yaml(plan(dp=2)))
    return make_run(root / "run", steps=(2, 5), dp=2)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def resign(ckpt: Path, edit) -> None:
    """Apply ``edit`` to the manifest (a dict edited in place, or a function returning the new
    bytes) and re-sign it, so that only the manifest's content is wrong."""
    doc = json.loads((ckpt / MANIFEST).read_bytes())
    out = edit(doc)
    data = out if isinstance(out, bytes) else json.dumps(doc).encode()
    (ckpt / MANIFEST).write_bytes(data)
    marker = json.loads((ckpt / COMMITTED).read_bytes())
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    (ckpt / COMMITTED).write_text(json.dumps(marker))


def resign_index(ckpt: Path, edit, rank: int = 0) -> None:
    """Apply ``edit`` to rank ``rank``'s shard index (a dict edited in place) and re-sign it: the
    manifest records the new size and sha256, the marker the new manifest."""
    doc = json.loads((ckpt / index_name(rank)).read_bytes())
    edit(doc)
    data = json.dumps(doc).encode()
    (ckpt / index_name(rank)).write_bytes(data)

    def record(m):
        ref = next(s for s in m["shards"] if s["rank"] == rank)["index"]
        ref["bytes"], ref["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    resign(ckpt, record)


def no_crash(code: int, out: str, err: str) -> bool:
    """The CLI answered with a message of its own: no traceback, no 'internal error'."""
    text = out + err
    return "Traceback" not in text and "internal error" not in text and code in (0, 1, 2, 3)
