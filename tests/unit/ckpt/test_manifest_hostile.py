"""Manifests and shard indexes that are well-formed JSON, re-signed so every checksum passes, but
wrong: each is refused by the schema before any of it is used, naming the file and the field, by
every reader (verify, ls, load, convert, resume) and through the CLI without a traceback."""

from __future__ import annotations

import json
import os

import pytest

from mscale.ckpt import catalog
from mscale.ckpt.load import CheckpointReader
from mscale.ckpt.manifest import MANIFEST, index_name
from mscale.ckpt.resume import choose_resume
from mscale.ckpt.verify import verify
from mscale.errors import MscaleError
from tests.unit.ckpt.hostile import copy_run, make_run, no_crash, resign, resign_index


def _slice(doc, k=0):
    """Slice ``k`` of a shard index."""
    return doc["slices"][k]


def _set(path, value):
    """An edit setting doc[path...] = value."""
    def edit(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _raw(fn):
    """An edit of the manifest's text."""
    return lambda doc: fn(json.dumps(doc)).encode()


CASES = {
    # (edit, field the error names, or None, and a fragment of the message)
    "layout missing pp": (lambda d: d["layout"].pop("pp"), "layout.pp", "missing"),
    "nested 200k deep": (lambda d: b"[" * 200_000 + b"]" * 200_000, None, "nests 200000"),
    "plan hidden wide": (_set(["plan", "model", "hidden"], "wide"), "plan.model.hidden",
                         "integer"),
    "clip state": (_set(["state", "clip"], {"x": "y"}), "state.clip.version", "missing"),
    "clip ema NaN": (_raw(lambda t: t.replace('"clip": {}', '"clip": {"version": 1, '
                                                '"ema": NaN, "count": 3}')), None, "NaN"),
    "step as text": (_set(["step"], "5"), "step", "integer"),
    "integer of 5000 digits": (_raw(lambda t: t.replace('"step": 5', '"step": ' + "9" * 5000)),
                               None, "5000 digits"),
    "float overflow": (_raw(lambda t: t.replace('"time": ', '"time": 1e999, "x": ')), None,
                       "out of range"),
    "state step differs": (_set(["state", "step"], 9), "state.step", "step 9"),
    "layout differs from plan": (_set(["layout", "tp"], 2), "layout", "world"),
    "rank outside the world": (_set(["shards", 0, "rank"], 7), "shards[0].rank", "outside"),
    "utf-16": (lambda d: json.dumps(d).encode("utf-16-le"), None, "NUL byte"),
    "binary": (lambda d: b"\xff\xfe\x80" + json.dumps(d).encode(), None, "UTF-8"),
    "not an object": (lambda d: b"[1, 2]", None, "JSON object"),
    "index outside the directory": (_set(["shards", 0, "index", "path"], "../rank-00000.json"),
                                    "shards[0].index.path", "plain file name"),
    "index of 2^40 bytes": (_set(["shards", 0, "index", "bytes"], 1 << 40),
                            "shards[0].index.bytes", "less than or equal"),
    "schema 2 without an index": (_set(["shards", 0, "index"], None), None, "index file"),
}


INDEX_CASES = {
    # edits of rank 0's shard index, re-signed into the manifest (schema 2 keeps slices there)
    "chunk of one number": (lambda d: _slice(d)["chunks"].__setitem__(0, [1]),
                            "slices[0].chunks[0]", "at least 2"),
    "negative chunk length": (lambda d: _slice(d)["chunks"][0].__setitem__(0, -5),
                              "slices[0].chunks[0][0]", "greater than or equal"),
    "chunk of 2^46 bytes": (lambda d: _slice(d)["chunks"][0].__setitem__(0, 1 << 46),
                            "slices[0].chunks[0]", "bytes stored"),
    "chunk missing": (lambda d: _slice(d)["chunks"].pop(), "slices[0].chunks",
                      "chunks for"),
    "box outside the tensor": (lambda d: _slice(d)["box"][0].__setitem__(1, 10 ** 6),
                               "slices[0].box", "not inside"),
    "offset past the shard": (lambda d: _slice(d, 1).__setitem__("offset", 1 << 40),
                              "slices[1].offset", "beyond the shard"),
    "unknown tensor": (lambda d: _slice(d).__setitem__("tensor", "model/nothing"),
                       "slices[0].tensor", "unknown tensor"),
    "index of another shard": (_set(["shard"], "rank-00001.bin"), "shard", "describes"),
    "slices as text": (_set(["slices"], "none"), "slices", "list"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("good") / "run")


@pytest.fixture(params=sorted(CASES))
def tampered(request, good, tmp_path):
    edit, field, fragment = CASES[request.param]
    run = copy_run(good, tmp_path / "run")
    resign(run / "ckpt" / "step-000005", edit)
    return run, field, fragment


def test_every_reader_refuses_it_naming_manifest_and_field(tampered):
    run, field, fragment = tampered
    ckpt = str(run / "ckpt" / "step-000005")
    rep = verify(ckpt)
    assert rep.problems[0].file == MANIFEST and not rep.ok, rep.problems
    assert fragment in rep.problems[0].message and (field is None
                                                    or rep.problems[0].field == field)
    for load in (catalog.load_committed, catalog.load_manifest):
        with pytest.raises(MscaleError) as e:
            load(ckpt)
        assert e.value.file.endswith(MANIFEST) and e.value.code == 2
        assert field is None or e.value.field == field
    with pytest.raises(MscaleError) as e:
        choose_resume(str(run / "ckpt"), "auto")
    assert e.value.file.endswith(MANIFEST)


def test_cli_names_it_without_a_traceback(tampered, cli, tmp_path):
    run, _, fragment = tampered
    code, out, err = cli("ckpt", "verify", str(run / "ckpt" / "latest"))
    assert code == 2 and no_crash(code, out, err) and MANIFEST in out
    code, out, err = cli("ckpt", "ls", str(run), "--json")
    doc = json.loads(out)
    assert code == 1 and no_crash(code, out, err)
    assert doc["checkpoints"][0]["status"] != "committed"
    assert any(fragment in w for w in doc["warnings"]), doc["warnings"]
    code, out, err = cli("ckpt", "convert", str(run), str(tmp_path / "hf"), "--to-hf")
    assert code == 2 and no_crash(code, out, err) and MANIFEST in err
    assert not (tmp_path / "hf").exists()


@pytest.fixture(params=sorted(INDEX_CASES))
def tampered_index(request, good, tmp_path):
    edit, field, fragment = INDEX_CASES[request.param]
    run = copy_run(good, tmp_path / "run")
    resign_index(run / "ckpt" / "step-000005", edit)
    return run, field, fragment


def test_every_reader_of_slices_refuses_a_tampered_index_naming_it(tampered_index):
    run, field, fragment = tampered_index
    ckpt = str(run / "ckpt" / "step-000005")
    rep = verify(ckpt)
    assert rep.problems[0].file == index_name(0) and not rep.ok, rep.problems
    assert fragment in rep.problems[0].message and rep.problems[0].field == field
    manifest = catalog.load_committed(ckpt)  # the manifest itself is sound
    with pytest.raises(MscaleError) as e:
        CheckpointReader(ckpt, manifest)
    assert e.value.file.endswith(index_name(0)) and e.value.code == 2
    assert e.value.field == field


def test_an_index_changed_after_the_commit_is_refused(good, tmp_path):
    run = copy_run(good, tmp_path / "run")
    ckpt = run / "ckpt" / "step-000005"
    path = ckpt / index_name(0)
    doc = json.loads(path.read_bytes())
    doc["slices"].reverse()
    path.write_text(json.dumps(doc) + " ")  # not re-signed: another size
    rep = verify(str(ckpt))
    assert rep.problems[0].file == index_name(0) and "bytes" in rep.problems[0].message
    size = catalog.load_committed(str(ckpt)).shards[0].index.bytes
    data = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(data + b" " * (size - len(data)))  # the recorded size: only the hash tells
    rep = verify(str(ckpt))
    assert rep.problems[0].file == index_name(0) and "sha256" in rep.problems[0].message
    assert len(rep.problems) == 1  # not also every element of its slices as "missing"
    with pytest.raises(MscaleError) as e:
        CheckpointReader(str(ckpt), catalog.load_committed(str(ckpt)), prefer=[0])
    assert "sha256" in e.value.message and e.value.code == 2
    os.remove(path)
    rep = verify(str(ckpt))
    assert rep.problems[0].file == index_name(0) and "missing" in rep.problems[0].message


def test_cli_names_a_tampered_index_without_a_traceback(good, cli, tmp_path):
    run = copy_run(good, tmp_path / "run")
    resign_index(run / "ckpt" / "step-000005", INDEX_CASES["unknown tensor"][0])
    code, out, err = cli("ckpt", "verify", str(run / "ckpt" / "latest"))
    assert code == 2 and no_crash(code, out, err) and index_name(0) in out
    code, out, err = cli("ckpt", "convert", str(run), str(tmp_path / "hf"), "--to-hf")
    assert code == 2 and no_crash(code, out, err) and index_name(0) in err
    assert not (tmp_path / "hf").exists()


def test_depth_is_bounded_before_parsing():
    from mscale.config.json_reader import json_depth as depth

    assert depth(b'{"a": [[1, 2], {"b": "[[[[{{"}]}') == 3
    assert depth(b'"\\"[[["') == 0 and depth(b"") == 0
