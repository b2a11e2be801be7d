"""The fuzz suite's cases for `mscale ckpt ls`, `verify` and `convert` (see fuzz_cases.Case).

Damaged checkpoints are private copies of the shared one. Manifests that are well-formed JSON
but wrong are re-signed (the commit marker's sha256 rewritten), so the reader meets the damage
itself rather than the sha mismatch in front of it. `verify` reports a damaged checkpoint with
exit 2; reading one for `convert` is refused with 2 (integrity) or 3.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

from tests.e2e.fuzz_cases import FILE_KINDS, Build, Case
from tests.e2e.fuzz_inputs import BAD_TEXT, DEEP, DELETE, Workspace

DAMAGED = (2, 3)
LISTED = (1, 3)
"""`ls` of a run with a damaged pointer: a listing and a warning (1), or an error (3)."""


# -- what a case damages ------------------------------------------------------------------------


def latest(text: bytes) -> Callable[[Workspace], str]:
    """The run copy with ``latest`` replaced; returns the run directory."""
    def make(ws: Workspace) -> str:
        run = ws.run_copy()
        ws.put("run/ckpt/latest", text)
        return str(run)
    return make


def latest_is_dir(ws: Workspace) -> str:
    run = ws.run_copy()
    os.unlink(run / "ckpt" / "latest")
    (run / "ckpt" / "latest").mkdir()
    ws.mark(run / "ckpt" / "latest")
    return str(run)


def manifest_file(how: str) -> Callable[[Workspace], str]:
    """The checkpoint copy with manifest.json replaced by a `Workspace.spoil` kind."""
    def make(ws: Workspace) -> str:
        ck = ws.ckpt_copy()
        os.unlink(ck / "manifest.json")
        ws.spoil(ws.base.ckpt / "manifest.json", str((ck / "manifest.json").relative_to(ws.root)),
                 how)
        return str(ck)
    return make


def manifest_edit(changes, resign: bool = True) -> Callable[[Workspace], str]:
    return lambda ws: str(ws.edit_manifest(changes, resign))


def index_edit(changes) -> Callable[[Workspace], str]:
    return lambda ws: str(ws.edit_index(changes))


def marker_file(data: bytes | None) -> Callable[[Workspace], str]:
    def make(ws: Workspace) -> str:
        ck = ws.ckpt_copy()
        os.unlink(ck / "COMMITTED")
        if data is None:
            ws.mark(ck / "COMMITTED")
        else:
            ws.put(str((ck / "COMMITTED").relative_to(ws.root)), data)
        return str(ck)
    return make


def shard(how: str) -> Callable[[Workspace], str]:
    """rank-00001.bin replaced: dir, fifo, missing, truncated, flipped (one bit), outside (a
    symlink to a file outside the checkpoint)."""
    def make(ws: Workspace) -> str:
        ck = ws.ckpt_copy()
        p = ck / "rank-00001.bin"
        data = p.read_bytes()
        p.unlink()
        if how == "dir":
            p.mkdir()
        elif how == "fifo":
            os.mkfifo(p)
        elif how == "truncated":
            p.write_bytes(data[: len(data) // 2])
        elif how == "flipped":
            p.write_bytes(data[:100] + bytes([data[100] ^ 4]) + data[101:])
        elif how == "outside":
            (ws.root / "elsewhere.bin").write_bytes(data)
            p.symlink_to(ws.root / "elsewhere.bin")
        ws.mark(p)
        return str(ck)
    return make


def _chunks(value) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        doc["slices"][0]["chunks"][0] = value
    return change


def _state_clip(doc: dict) -> None:
    doc["state"]["clip"] = {"history": "not a list", "window": -3, "ratio": "wide"}


MANIFEST_EDITS: list[tuple[str, object, str | None]] = [
    # (id, changes (dotted) or a function of the document, the field the report must name)
    ("layout-empty", {"layout": {}}, "layout"),
    ("layout-no-tp", {"layout.tp": DELETE}, "layout"),
    ("index-path-parent", {"shards.0.index.path": "../rank-00000.index.json"}, "path"),
    ("shape-negative", lambda d: d["tensors"][next(iter(d["tensors"]))].update(shape=[-1, 64]),
     "shape"),
    ("dtype-unknown", lambda d: d["tensors"][next(iter(d["tensors"]))].update(dtype="float8"),
     "dtype"),
    ("shard-path-parent", {"shards.0.path": "../rank-00000.bin"}, "path"),
    ("shard-path-absolute", {"shards.0.path": "/etc/passwd"}, "path"),
    ("chunk-bytes-0", {"chunk_bytes": 0}, "chunk_bytes"),
    ("schema-version-99", {"schema_version": 99}, "schema_version"),
    ("tensors-empty", {"tensors": {}}, "tensor"),
    ("plan-hidden-wide", {"plan.model.hidden": "wide"}, "plan.model.hidden"),
    ("state-clip-tampered", _state_clip, "state.clip"),
    ("step-differs-from-marker", {"step": 6}, "step"),
]

INDEX_EDITS: list[tuple[str, object, str | None]] = [
    # rank 0's shard index (its slices), re-signed into the manifest: (id, changes, field)
    ("chunk-arity-3", _chunks([1, 2, 3]), "chunks"),
    ("chunk-arity-1", _chunks([1]), "chunks"),
    ("chunk-negative", _chunks([-5, 0]), "chunks"),
    ("chunk-2-to-46", _chunks([2**46, 0]), "chunks"),
    ("flat-negative", {"slices.0.flat": [-4, 8]}, "flat"),
    ("offset-negative", {"slices.0.offset": -1}, "offset"),
    ("other-shard", {"shard": "rank-00001.bin"}, "shard"),
]


# -- the commands -------------------------------------------------------------------------------


def _ckpt_is_a_file(ws: Workspace) -> str:
    ws.put("run/ckpt", "keep\n")
    return ws.mark(ws.root / "run")


def ls_cases() -> Iterator[Case]:
    def ls(make: Callable[[Workspace], str], *extra: str) -> Build:
        return lambda ws: ["ckpt", "ls", make(ws), *extra]

    yield Case("ls-missing", ls(lambda ws: ws.mark(ws.root / "nowhere")))
    yield Case("ls-missing-json", ls(lambda ws: ws.mark(ws.root / "nowhere"), "--json"))
    yield Case("ls-foo", ls(lambda ws: ws.mark("foo://x/run")))
    yield Case("ls-a-file", ls(lambda ws: ws.put("run", "keep\n")))
    yield Case("ls-ckpt-is-a-file", ls(_ckpt_is_a_file))
    for name, text in (("binary", BAD_TEXT["binary"]("")), ("utf16", "step-000005\n".encode(
            "utf-16")), ("empty", b""), ("outside", b"../../../etc\n"), ("absolute", b"/etc\n")):
        yield Case(f"ls-latest-{name}", ls(latest(text)), code=LISTED,
                   subprocess=name == "outside")
    yield Case("ls-latest-a-directory", ls(latest_is_dir), code=LISTED)
    for how in ("binary", "deep"):  # a listing that shows the damage, or an error
        yield Case(f"ls-manifest-{how}", ls(lambda ws, how=how: os.path.dirname(os.path.dirname(
            manifest_file(how)(ws)))), code=(0, 1, 2))


def verify_cases() -> Iterator[Case]:
    def verify(make: Callable[[Workspace], str], *extra: str) -> Build:
        return lambda ws: ["ckpt", "verify", make(ws), *extra]

    yield Case("verify-missing", verify(lambda ws: ws.mark(ws.root / "nowhere")))
    yield Case("verify-foo", verify(lambda ws: ws.mark("foo://x/ckpt")))
    yield Case("verify-foo-json", verify(lambda ws: ws.mark("foo://x/ckpt"), "--json"))
    yield Case("verify-a-binary-file", verify(lambda ws: ws.put("ckpt.bin",
                                                                BAD_TEXT["binary"](""))),
               code=DAMAGED)
    yield Case("verify-empty-directory", verify(lambda ws: ws.spoil(ws.root, "empty", "dir")))
    for name, text in (("binary", BAD_TEXT["binary"]("")), ("utf16", "step-000005\n".encode(
            "utf-16")), ("empty", b""), ("outside", b"../../../etc\n"), ("absolute", b"/etc\n"),
            ("names-a-missing-step", b"step-000099\n")):
        yield Case(f"verify-latest-{name}", lambda ws, text=text: [
            "ckpt", "verify", latest(text)(ws) + "/ckpt/latest"],
            code=DAMAGED)
    yield Case("verify-latest-a-directory", lambda ws: [
        "ckpt", "verify", latest_is_dir(ws) + "/ckpt/latest"], code=DAMAGED)
    for how in (*BAD_TEXT, "dir", "missing"):
        yield Case(f"verify-manifest-{how}", verify(manifest_file(how)), code=2)
    for name, changes, field in MANIFEST_EDITS:
        yield Case(f"verify-manifest-{name}", verify(manifest_edit(changes)), code=2,
                   field=field, isolate=name == "chunk-2-to-46")
    for name, changes, field in INDEX_EDITS:
        yield Case(f"verify-index-{name}", verify(index_edit(changes)), code=2, field=field,
                   isolate=name == "chunk-2-to-46")
    yield Case("verify-manifest-not-resigned", verify(manifest_edit({"step": 5, "level": 9},
                                                                    resign=False)), code=2)
    for how in ("dir", "fifo", "missing", "truncated", "flipped", "outside"):
        yield Case(f"verify-shard-{how}", verify(shard(how)), code=2, isolate=how == "fifo")
    for name, data in (("binary", BAD_TEXT["binary"]("")), ("deep", DEEP), ("list", b"[1]"),
                       ("missing", None)):
        yield Case(f"verify-marker-{name}", verify(marker_file(data)), code=2)


def convert_argv(src: str, dst: str, *extra: str) -> list[str]:
    return ["ckpt", "convert", src, dst, *extra]


def _to_plan(ws: Workspace) -> list[str]:
    return ["--plan", str(ws.base.plan1)]


def hf_config(make: Callable[[str], bytes]) -> Build:
    """The HF export copied with config.json replaced by ``make(good text)``, imported with
    --plan."""
    def build(ws: Workspace) -> list[str]:
        import shutil

        hf = ws.root / "hf"
        shutil.copytree(ws.base.hf, hf)
        ws.put("hf/config.json", make((hf / "config.json").read_text()))
        return convert_argv(str(hf), str(ws.root / "out"), *_to_plan(ws))
    return build


def json_edit(changes: dict) -> Callable[[str], bytes]:
    from tests.e2e.fuzz_inputs import edit

    return lambda text: json.dumps(edit(json.loads(text), changes)).encode()


def hf_weights(data: bytes) -> Build:
    def build(ws: Workspace) -> list[str]:
        import shutil

        hf = ws.root / "hf"
        shutil.copytree(ws.base.hf, hf)
        ws.put("hf/model.safetensors", data)
        return convert_argv(str(hf), str(ws.root / "out"), *_to_plan(ws))
    return build


def convert_cases() -> Iterator[Case]:
    def good(ws: Workspace, *extra: str, dst: str | None = None) -> list[str]:
        return convert_argv(str(ws.base.run), dst or str(ws.root / "out"),
                            *(extra or _to_plan(ws)))

    yield Case("convert-src-missing", lambda ws: convert_argv(
        ws.mark(ws.root / "nowhere"), str(ws.root / "out"), *_to_plan(ws)))
    yield Case("convert-src-foo", lambda ws: convert_argv(
        ws.mark("foo://x/run"), str(ws.root / "out"), *_to_plan(ws)))
    yield Case("convert-dst-foo", lambda ws: good(ws, dst=ws.mark("foo://x/out")),
               subprocess=True)
    yield Case("convert-dst-foo-to-hf", lambda ws: good(ws, "--to-hf",
                                                        dst=ws.mark("foo://x/out")))
    yield Case("convert-dst-a-file", lambda ws: good(ws, dst=ws.put("out", "keep\n")))
    yield Case("convert-dst-under-a-file", lambda ws: good(
        ws, dst=ws.put("out", "keep\n") + "/ckpt"))
    yield Case("convert-dst-not-empty", lambda ws: good(
        ws, dst=(ws.put("out/keep.txt", "keep\n"), ws.mark(ws.root / "out"))[1]))
    yield Case("convert-level-99", lambda ws: good(ws, *_to_plan(ws), "--zstd-level", "99"),
               field="--zstd-level", subprocess=True)
    yield Case("convert-level-negative", lambda ws: good(ws, *_to_plan(ws), "--zstd-level",
                                                         "-100"), field="--zstd-level")
    yield Case("convert-level-99-json", lambda ws: good(ws, *_to_plan(ws), "--zstd-level", "99",
                                                        "--json"), field="--zstd-level")
    yield Case("convert-neither-target", lambda ws: good(ws, "--zstd-level", "1"),
               field="--plan")
    yield Case("convert-both-targets", lambda ws: good(ws, *_to_plan(ws), "--to-hf"),
               field="--plan")
    for how in FILE_KINDS:
        yield Case(f"convert-plan-{how}", lambda ws, how=how: good(
            ws, "--plan", ws.spoil(ws.base.plan1, "plan.yaml", how)))
    yield Case("convert-plan-hidden-wide", lambda ws: good(ws, "--plan", ws.variant(
        ws.base.plan1, "plan.yaml", {"model.hidden": "wide"})), field="model.hidden")
    yield Case("convert-plan-other-model", lambda ws: good(ws, "--plan", ws.variant(
        ws.base.plan1, "plan.yaml", {"model.layers": 2})), field="model")
    for how in ("binary", "deep"):
        yield Case(f"convert-manifest-{how}", lambda ws, how=how: convert_argv(
            manifest_file(how)(ws), str(ws.root / "out"), *_to_plan(ws)), code=DAMAGED)
    for name, changes, field in MANIFEST_EDITS:
        if name in ("plan-hidden-wide", "state-clip-tampered", "layout-empty"):
            target = ("--to-hf",) if name == "plan-hidden-wide" else ()
            yield Case(f"convert-manifest-{name}", lambda ws, c=changes, t=target: convert_argv(
                manifest_edit(c)(ws), str(ws.root / "out"), *(t or _to_plan(ws))),
                code=DAMAGED, field=field)
    for name, changes, field in INDEX_EDITS:
        if name in ("chunk-arity-3", "chunk-negative", "chunk-2-to-46"):
            yield Case(f"convert-index-{name}", lambda ws, c=changes: convert_argv(
                index_edit(c)(ws), str(ws.root / "out"), *_to_plan(ws)),
                code=DAMAGED, field=field, isolate=name == "chunk-2-to-46")
    yield Case("convert-shard-fifo", lambda ws: convert_argv(
        shard("fifo")(ws), str(ws.root / "out"), *_to_plan(ws)), code=DAMAGED, isolate=True)
    yield Case("convert-latest-outside", lambda ws: convert_argv(
        latest(b"../../../etc\n")(ws), str(ws.root / "out"), *_to_plan(ws)), code=DAMAGED)
    yield Case("convert-moves-latest-backwards", _backwards)
    for how, make in BAD_TEXT.items():
        yield Case(f"convert-hf-config-{how}", hf_config(make))
    for name, changes, field in (("no-hidden", {"hidden_size": DELETE}, "hidden_size"),
                                 ("hidden-wide", {"hidden_size": "wide"}, "hidden_size"),
                                 ("mscale-hidden-wide", {"mscale_model.hidden": "wide"},
                                  "hidden"),
                                 ("layers-1e9", {"num_hidden_layers": 10**9},
                                  "num_hidden_layers")):
        yield Case(f"convert-hf-config-{name}", hf_config(json_edit(changes)), field=field,
                   isolate=name == "layers-1e9")
    yield Case("convert-hf-weights-header-2-to-63", hf_weights(
        (2**63).to_bytes(8, "little") + b"{}"), field="safetensors header")
    yield Case("convert-hf-weights-binary", hf_weights(BAD_TEXT["binary"]("")),
               field="safetensors header")


def _backwards(ws: Workspace) -> list[str]:
    """Converting into RUN/ckpt/step-000001 of a run whose latest is step-000005 would move
    `latest` back in time: a resumed run would silently lose four steps."""
    run = ws.run_copy()
    return convert_argv(str(ws.base.run), ws.mark(run / "ckpt" / "step-000001"),
                        "--plan", str(ws.base.plan2))
