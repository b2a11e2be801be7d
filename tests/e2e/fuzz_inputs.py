"""Inputs of the fuzz suite (test_fuzz.py): one set of good files built once, per-case workspaces
that break one of them, and the check that nothing the command was given got damaged.

The good set (`Base`, built once per session, read-only to cases): the example cluster, model and
training files; the embedded tiny plan and two smaller variants of it; a real committed checkpoint
of the 2-process variant in a run directory (written offline, the way `ckpt convert` writes one:
no training needed); its HuggingFace export. A case copies what it damages into its own
`Workspace`, which is also the working directory, so a stray relative path (``foo:/x``) shows up
there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from tests.conftest import PLANS, REPO

MSCALE = str(Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "mscale")
if not os.path.exists(MSCALE):
    MSCALE = shutil.which("mscale") or MSCALE

PRESET = REPO / "src" / "mscale" / "presets" / "cpu-tiny.yaml"
STEP = "step-000005"

BINARY = bytes(range(256)) * 8 + b"\x00\xff\xfe\x80" * 64
"""Not text in any encoding a config could be in: NULs, invalid UTF-8."""
DEEP = b"[" * 200_000 + b"]" * 200_000
"""Nested 200k deep: a recursive parser's stack, not a memory problem."""
ALIAS_BOMB = "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)])
"""Billion laughs: 10^9 leaves from a few hundred bytes of YAML."""

BAD_TEXT: dict[str, Callable[[str], bytes]] = {
    "binary": lambda good: BINARY,
    "utf16": lambda good: good.encode("utf-16"),
    "empty": lambda good: b"",
    "deep": lambda good: DEEP,
    "scalar": lambda good: b"42\n",
}
"""Contents that are not the mapping a YAML or JSON file must hold, from the good text."""


class Raw(str):
    """A YAML scalar written as is (``.inf``, ``1e12``), not quoted as the string it is."""


DELETE = object()
"""A value in `edit`: remove the key."""


def edit(data: Any, changes: dict[str, Any]) -> Any:
    """Apply ``{"dotted.path": value}`` changes to parsed YAML/JSON (list indices as numbers)."""
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = int(last) if isinstance(node, list) else last
        if value is DELETE:
            del node[key]
        else:
            node[key] = value
    return data


def dump_yaml(data: Any) -> str:
    """YAML text with `Raw` values left unquoted."""
    raws: dict[str, str] = {}

    def mark(v):
        if isinstance(v, Raw):
            raws[f"RAW{len(raws)}X"] = str(v)
            return f"RAW{len(raws) - 1}X"
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v

    text = yaml.safe_dump(mark(data), sort_keys=False)
    for key, raw in raws.items():
        text = text.replace(key, raw)
    return text


@dataclass
class Base:
    """The good inputs, shared by every case and never changed by one."""

    root: Path
    cluster: Path
    model: Path
    training: Path
    plan8: Path
    """The embedded demo plan: 8 processes, tp2 pp2 dp2."""
    plan2: Path
    """The same model on one node of two processes (dp2): the checkpoint's layout."""
    plan1: Path
    """The same model on one process: a target layout for `convert --plan`."""
    run: Path
    """A run directory whose ckpt/ holds one committed checkpoint (`STEP`) and `latest`."""
    hf: Path
    """The checkpoint exported to HuggingFace safetensors."""

    @property
    def ckpt(self) -> Path:
        return self.run / "ckpt" / STEP

    def cpu_args(self) -> list[str]:
        return ["--cluster", str(self.cluster), "--model", str(self.model),
                "--training", str(self.training)]


def _variant(src: Path, dst: Path, changes: dict[str, Any]) -> Path:
    dst.write_text(dump_yaml(edit(yaml.safe_load(src.read_text()), changes)))
    return dst


def build_base(root: Path) -> Base:
    """Write the good inputs (about a second: the checkpoint is written offline, not trained)."""
    from mscale.ckpt.convert import convert
    from mscale.config.plan import load_plan

    from tests.unit.ckpt.helpers import global_state, write_synthetic

    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind, name in (("cluster", "clusters/cpu-4x2.yaml"), ("model", "models/tiny.yaml"),
                       ("training", "training/cpu-demo.yaml")):
        files[kind] = root / Path(name).name
        shutil.copy(PLANS / name, files[kind])
    plan8 = root / "plan8.yaml"
    shutil.copy(PRESET, plan8)
    one_node = {"cluster.hostlist": "node1"}
    plan2 = _variant(PRESET, root / "plan2.yaml", {**one_node, "layout.tp": 1, "layout.pp": 1,
                                                   "layout.sequence_parallel": False})
    plan1 = _variant(PRESET, root / "plan1.yaml", {**one_node, "cluster.gpus_per_node": 1,
                                                   "layout.tp": 1, "layout.pp": 1,
                                                   "layout.dp": 1,
                                                   "layout.sequence_parallel": False})
    run = root / "run"
    p2 = load_plan(str(plan2))
    write_synthetic(str(run / "ckpt" / STEP), p2, global_state(p2), step=5, chunk_bytes=4096)
    hf = root / "hf"
    convert(str(run), str(hf), to_hf=True)
    return Base(root, files["cluster"], files["model"], files["training"], plan8, plan2, plan1,
                run, hf)


@dataclass
class Workspace:
    """One case's directory (its working directory too) and the path it broke."""

    root: Path
    base: Base
    bad: str | None = None
    """The file or URL the case made bad: the report must name it."""
    notes: dict[str, Any] = field(default_factory=dict)

    def put(self, name: str, data: bytes | str) -> str:
        """Write a file in the workspace and mark it as the bad input."""
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return self.mark(p)

    def mark(self, path: Path | str) -> str:
        self.bad = str(path)
        return self.bad

    def variant(self, src: Path, name: str, changes: dict[str, Any]) -> str:
        """``src`` (YAML) with fields changed."""
        return self.put(name, dump_yaml(edit(yaml.safe_load(src.read_text()), changes)))

    def spoil(self, src: Path, name: str, how: str) -> str:
        """``src`` replaced by something that is not a regular file of text, or by bad text.

        ``how``: a `BAD_TEXT` key, ``dir``, ``missing``, ``foo`` (an unknown protocol),
        ``fifo`` (a named pipe nobody writes), ``mode000`` (the good text, unreadable).
        """
        p = self.root / name
        if how in BAD_TEXT:
            return self.put(name, BAD_TEXT[how](src.read_text() if src.is_file() else ""))
        if how == "mode000":
            self.put(name, src.read_bytes())
            p.chmod(0)
        elif how == "dir":
            p.mkdir(parents=True)
        elif how == "fifo":
            os.mkfifo(p)
        elif how == "foo":
            return self.mark(f"foo://bucket/{name}")
        elif how != "missing":
            raise ValueError(how)
        return self.mark(p)

    def run_copy(self) -> Path:
        """A private copy of the base run directory (to damage)."""
        dst = self.root / "run"
        if not dst.exists():
            shutil.copytree(self.base.run, dst, symlinks=True)
        return dst

    def ckpt_copy(self) -> Path:
        return self.run_copy() / "ckpt" / STEP

    def edit_manifest(self, changes: dict[str, Any] | Callable[[dict], Any],
                      resign: bool = True) -> Path:
        """Change the copy's manifest.json; ``resign`` rewrites the commit marker's sha256 too, so
        the checkpoint is consistent but wrong (as a buggy or hostile writer would leave it)."""
        ck = self.ckpt_copy()
        doc = json.loads((ck / "manifest.json").read_text())
        doc = changes(doc) or doc if callable(changes) else edit(doc, changes)
        raw = json.dumps(doc).encode()
        (ck / "manifest.json").write_bytes(raw)
        if resign:
            marker = json.loads((ck / "COMMITTED").read_text())
            marker["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
            (ck / "COMMITTED").write_text(json.dumps(marker))
        self.mark(ck / "manifest.json")
        return ck

    def edit_index(self, changes: dict[str, Any] | Callable[[dict], Any], rank: int = 0) -> Path:
        """Change the copy's rank-NNNNN.index.json (a shard's slice table) and re-sign it: the
        manifest records its new size and sha256, the marker the new manifest."""
        ck = self.ckpt_copy()
        path = ck / f"rank-{rank:05d}.index.json"
        doc = json.loads(path.read_text())
        doc = changes(doc) or doc if callable(changes) else edit(doc, changes)
        raw = json.dumps(doc).encode()
        path.write_bytes(raw)

        def record(manifest: dict) -> None:
            ref = next(s for s in manifest["shards"] if s["rank"] == rank)["index"]
            ref["bytes"], ref["sha256"] = len(raw), hashlib.sha256(raw).hexdigest()
        self.edit_manifest(record)
        self.mark(path)  # the index is what is wrong, not the manifest that names it
        return ck


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, mode and content hash: "nothing damaged" is
    two equal snapshots."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
                out[rel] = ("file", st.st_mode, digest)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            else:
                out[rel] = (stat.S_IFMT(st.st_mode), st.st_mode)
    return out
