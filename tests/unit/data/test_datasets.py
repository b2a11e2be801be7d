"""datasets: every token source a training file may name opened and verified — manifest folders
(across shards, from the manifest and one listing), folders and globs of Megatron prefixes, flat
files, memory:// — read token-exact; every malformed source, manifest or shard entry refused with
the file and field named. The Megatron files themselves: test_indexed.py."""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pytest

from mscale.data.datasets import open_dataset, verify_dataset
from mscale.data.indexed import IndexedWriter
from mscale.errors import MscaleError

from tests.unit.data.folders import DOCS, FLAT, STARTS, reference_write, refused, write_manifest


def test_manifest_folder_reads_across_shards(tmp_path):
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:3], DOCS[3:]])
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.num_tokens == len(FLAT) and ds.vocab_size == 100 and ds.eod_id == 0
    assert ds.read(0, len(FLAT)).tolist() == FLAT
    assert ds.read(2, 10).tolist() == FLAT[2:10]  # three shards in one read
    assert ds.document_starts().tolist() == STARTS
    assert verify_dataset(str(tmp_path / "ds")) == []


def test_next_document_start_reads_only_the_index_its_position_falls_in(tmp_path, monkeypatch):
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:3], DOCS[3:]])
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.documents == len(DOCS) and [s.documents for s in ds.shards] == [2, 1, 1]
    assert not hasattr(ds, "doc_offsets")  # nothing a document kept in memory
    read = []
    for s in ds.shards:
        monkeypatch.setattr(s, "document_starts",
                            lambda f=s.document_starts: read.append(f) or f())
    want = [next(o for o in STARTS if o >= pos) for pos in range(len(FLAT) + 1)]
    for pos in range(len(FLAT) + 1):
        read.clear()
        assert ds.next_document_start(pos) == want[pos], pos
        assert len(read) <= 1  # one shard's index at most, none at a shard's first token
    assert ds.next_document_start(len(FLAT) + 5) == len(FLAT)


def test_verify_finds_a_changed_shard(tmp_path):
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    data = bytearray((tmp_path / "ds/shard-00001.bin").read_bytes())
    data[0] ^= 1  # same size, different token: only a checksum can tell
    (tmp_path / "ds/shard-00001.bin").write_bytes(bytes(data))
    problems = verify_dataset(str(tmp_path / "ds"))
    assert len(problems) == 1 and "shard-00001.bin" in problems[0]
    assert "manifest.shards[1].bin_sha256" in problems[0]


@pytest.mark.parametrize("damage, says", [
    ("truncate", "shard-00001.bin: sha256"),
    ("remove idx", "shard-00001.idx: missing (manifest.shards[1].prefix)"),
    ("garbage manifest", "manifest.json: manifest: not valid JSON"),
])
def test_verify_names_a_damaged_shard_or_manifest_as_a_problem_not_bad_input(tmp_path, damage,
                                                                             says):
    """A truncated, missing or unreadable file is what verify exists to find (exit 2); it used
    to fail at open, as bad input (exit 3)."""
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    if damage == "truncate":
        with open(tmp_path / "ds/shard-00001.bin", "r+b") as f:
            f.truncate(4)
    elif damage == "remove idx":
        (tmp_path / "ds/shard-00001.idx").unlink()
    else:
        (tmp_path / "ds/manifest.json").write_text("garbage")
    problems = verify_dataset(str(tmp_path / "ds"))
    assert says in problems[0]
    if damage == "truncate":  # and how: the structure is checked too (data inspect's line)
        assert len(problems) == 2 and "bin.size: .bin is 4 bytes but the index" in problems[1]
    else:
        assert len(problems) == 1


def test_verify_checks_a_megatron_prefix_for_structure_and_refuses_a_missing_path(tmp_path):
    reference_write(tmp_path / "a", DOCS)
    assert verify_dataset(str(tmp_path / "a")) == []
    with open(tmp_path / "a.bin", "r+b") as f:
        f.truncate(4)
    [problem] = verify_dataset(str(tmp_path / "a"))
    assert "a.bin: bin.size" in problem
    with pytest.raises(MscaleError, match="no such file"):
        verify_dataset(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MscaleError):  # nothing to verify: bad input, not a damaged dataset
        verify_dataset(str(tmp_path / "empty"))


def test_a_damaged_index_s_fix_is_its_source_kind_s(tmp_path):
    """One index check serves a Megatron pair and a prepared folder's shard; its fix named
    Megatron's tool "or mscale data prepare" for both, though prepare cannot rebuild a pair and
    Megatron's tool cannot rebuild a shard its manifest records. Each now gets its own, also
    when the index is read again at the held-out cut (a folder opened from its manifest)."""
    from mscale.data.indexed import REGENERATE
    from mscale.data.manifest import reprepare

    reference_write(tmp_path / "corpus", DOCS)
    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    for idx in (tmp_path / "corpus.idx", tmp_path / "ds" / "shard-00001.idx"):
        idx.write_bytes(idx.read_bytes()[:34])  # the header alone
    with pytest.raises(MscaleError) as e:
        open_dataset(str(tmp_path / "corpus"))
    assert e.value.fix == REGENERATE and "mscale data prepare INPUT..." in REGENERATE
    with pytest.raises(MscaleError) as e:
        open_dataset(str(tmp_path / "ds"), check_indexes=True)
    assert e.value.field == "idx.sequence_count" and e.value.fix == reprepare(str(tmp_path / "ds"))
    ds = open_dataset(str(tmp_path / "ds"))  # counts from the manifest: the index read at the cut
    with pytest.raises(MscaleError) as e:
        ds.next_document_start(ds.num_tokens - 1)
    assert e.value.fix == reprepare(str(tmp_path / "ds")) and "preprocess_data" not in e.value.fix


def test_a_damaged_folder_on_a_store_is_told_to_prepare_locally_and_copy(tmp_path):
    """The fix for a damaged prepared folder on an object store named `mscale data prepare ...
    --out s3://.../tokens --force`, which prepare refuses: it writes only a local folder."""
    from mscale.data.prepare import prepare

    write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    idx = tmp_path / "ds" / "shard-00001.idx"
    idx.write_bytes(idx.read_bytes()[:34])
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "ds"), "/damaged-test/ds", recursive=True)
    try:
        with pytest.raises(MscaleError) as e:
            open_dataset("memory://damaged-test/ds", check_indexes=True)
    finally:
        fs.rm("/damaged-test", recursive=True)
    assert "--out LOCAL_FOLDER, then copy LOCAL_FOLDER's files over memory://damaged-test/ds" \
        in e.value.fix and "--force" not in e.value.fix
    with pytest.raises(MscaleError, match="written to a local folder"):  # what the old fix ran
        prepare([str(tmp_path)], "unused", "memory://damaged-test/ds", force=True)


def test_folder_and_glob_of_prefixes(tmp_path):
    reference_write(tmp_path / "b", DOCS[2:])
    reference_write(tmp_path / "a", DOCS[:2])
    (tmp_path / "notes.txt").write_text("ignored")
    for spec in (str(tmp_path), str(tmp_path / "*.idx"), str(tmp_path / "[ab].*")):
        ds = open_dataset(spec)
        assert ds.read(0, ds.num_tokens).tolist() == FLAT
        assert ds.document_starts().tolist() == STARTS


def test_flat_files(tmp_path):
    np.array(FLAT, dtype="<u2").tofile(tmp_path / "train.bin")
    ds = open_dataset(str(tmp_path / "train.bin"))
    assert ds.read(0, ds.num_tokens).tolist() == FLAT and ds.documents is None
    np.array(FLAT + [70000], dtype="<u4").tofile(tmp_path / "tokens.u32")
    ds = open_dataset(str(tmp_path / "tokens.u32"), dtype="uint32")
    assert ds.read(len(FLAT) - 1, len(FLAT) + 1).tolist() == [11, 70000]
    np.array(FLAT, dtype="<u2").tofile(tmp_path / "val.bin")
    ds = open_dataset(str(tmp_path / "*.bin"))  # flat files only: concatenated, sorted
    assert ds.num_tokens == 2 * len(FLAT) and ds.read(0, 3).tolist() == FLAT[:3]


def test_memory_dataset(tmp_path):
    write_manifest(tmp_path / "ds", [DOCS[:3], DOCS[3:]])
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "ds"), "/indexed-test/ds", recursive=True)
    try:
        for spec in ("memory://indexed-test/ds", "memory://indexed-test/ds/shard-00000"):
            ds = open_dataset(spec)
            assert ds.read(0, ds.num_tokens).tolist() == FLAT[:ds.num_tokens]
        assert verify_dataset("memory://indexed-test/ds") == []
    finally:
        fs.rm("/indexed-test", recursive=True)


def test_flat_and_empty_refusals(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    refused(str(tmp_path / "odd.bin"), "flat.size", str(tmp_path / "odd.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    refused(str(tmp_path / "empty.bin"), "tokens", str(tmp_path / "empty.bin"))
    reference_write(tmp_path / "none", [])
    refused(str(tmp_path / "none"), "tokens", str(tmp_path / "none"))
    refused(str(tmp_path / "missing"), None, str(tmp_path / "missing"))
    reference_write(tmp_path / "c", DOCS)
    refused(str(tmp_path / "c"), "idx.dtype", str(tmp_path / "c.bin"), dtype="uint32")


def test_mixed_dtypes_and_mixed_kinds_are_refused(tmp_path):
    reference_write(tmp_path / "a", DOCS)
    reference_write(tmp_path / "b", DOCS, "int32")
    refused(str(tmp_path), "idx.dtype", str(tmp_path / "b.bin"))
    (tmp_path / "b.idx").unlink()  # b.bin is now a flat file beside a Megatron prefix
    refused(str(tmp_path), "spec", str(tmp_path))


MANIFEST_CASES = [
    ({"format": "other"}, "manifest.format"),
    ({"version": 2}, "manifest.version"),
    ({"dtype": "int8"}, "manifest.dtype"),
    ({"vocab_size": "big"}, "manifest.vocab_size"),
    ({"eod_id": 100}, "manifest.eod_id"),
    ({"tokens": 12}, "manifest.tokens"),
    ({"shards": []}, "manifest.shards"),
]


@pytest.mark.parametrize(("override", "field"), MANIFEST_CASES)
def test_bad_manifest_is_refused(tmp_path, override, field):
    write_manifest(tmp_path / "ds", [DOCS], **override)
    refused(str(tmp_path / "ds"), field, str(tmp_path / "ds/manifest.json"))


@pytest.mark.parametrize(("key", "value", "field"), [
    ("prefix", "../evil", "manifest.shards[1].prefix"),
    ("prefix", "/abs/shard", "manifest.shards[1].prefix"),
    ("prefix", "sub/shard", "manifest.shards[1].prefix"),
    ("prefix", "..", "manifest.shards[1].prefix"),
    ("prefix", "shard-00009", "manifest.shards[1].prefix"),  # listed but missing
    ("tokens", 8, "manifest.shards[1].tokens"),
    ("documents", 3, "manifest.shards[1].documents"),
    ("bin_bytes", 12, "manifest.shards[1].bin_bytes"),
    ("bin_sha256", None, "manifest.shards[1].bin_sha256"),
])
def test_bad_shard_entry_is_refused(tmp_path, key, value, field):
    m = write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    m["shards"][1][key] = value
    if key in ("tokens", "documents"):  # keep the totals consistent: the shard entry is wrong
        m[key] += value - [7, 2][key == "documents"]
    (tmp_path / "ds/manifest.json").write_text(json.dumps(m))
    if key != "documents":
        refused(str(tmp_path / "ds"), field, str(tmp_path / "ds/manifest.json"))
    refused(str(tmp_path / "ds"), field, str(tmp_path / "ds/manifest.json"), check_indexes=True)


def test_a_prepared_folder_opens_without_reading_its_indexes(tmp_path, monkeypatch):
    """Every rank opens every source: a prepared folder is opened from its manifest and one
    listing; an index is read where the held-out cut needs it, and checked then."""
    import mscale.data.indexed as indexed

    m = write_manifest(tmp_path / "ds", [DOCS[:2], DOCS[2:]])
    parsed = []
    real = indexed.parse_index
    monkeypatch.setattr(indexed, "parse_index", lambda idx, url, *a: parsed.append(url)
                        or real(idx, url, *a))
    ds = open_dataset(str(tmp_path / "ds"))
    assert parsed == [] and ds.documents == len(DOCS) and ds.read(0, 11).tolist() == FLAT
    assert ds.next_document_start(5) == 9 and parsed == [str(tmp_path / "ds/shard-00001.idx")]
    m["shards"][1]["documents"] = 3  # a manifest that disagrees with its index
    m["documents"] += 1
    (tmp_path / "ds/manifest.json").write_text(json.dumps(m))
    with pytest.raises(MscaleError, match="index holds 2 documents") as e:
        open_dataset(str(tmp_path / "ds")).next_document_start(5)
    assert e.value.file == str(tmp_path / "ds/shard-00001.idx")
    assert any("manifest.shards[1].documents" in p for p in verify_dataset(str(tmp_path / "ds")))


def test_a_prepared_folder_of_symlinked_shards_opens(tmp_path):
    """Its sizes come from one listing, which must give a link's target's size."""
    write_manifest(tmp_path / "real", [DOCS[:2], DOCS[2:]])
    (tmp_path / "ds").mkdir()
    for f in (tmp_path / "real").iterdir():
        (tmp_path / "ds" / f.name).symlink_to(f)
    ds = open_dataset(str(tmp_path / "ds"))
    assert ds.read(0, ds.num_tokens).tolist() == FLAT and ds.next_document_start(5) == 9


def test_an_opened_megatron_glob_keeps_one_file_open_a_shard(tmp_path):
    """A mapping of each .idx kept for the cut was a second descriptor a shard: 600 shards
    failed to open under a 1,024-descriptor limit."""
    import os

    for i in range(40):
        reference_write(tmp_path / f"p{i:03d}", DOCS)
    before = len(os.listdir("/proc/self/fd"))
    ds = open_dataset(str(tmp_path / "*.idx"))
    assert len(os.listdir("/proc/self/fd")) - before <= 40 + 2
    assert ds.next_document_start(5) == 9 and ds.documents == 40 * len(DOCS)


def test_a_shard_listed_twice_is_refused(tmp_path):
    m = write_manifest(tmp_path / "ds", [DOCS])
    m["shards"] *= 2
    m["tokens"], m["documents"] = 2 * m["tokens"], 2 * m["documents"]
    (tmp_path / "ds/manifest.json").write_text(json.dumps(m))
    refused(str(tmp_path / "ds"), "manifest.shards", str(tmp_path / "ds/manifest.json"))


def test_manifest_that_is_not_json(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds/manifest.json").write_text("{not json")
    refused(str(tmp_path / "ds"), "manifest", str(tmp_path / "ds/manifest.json"))


def test_a_glob_of_extensionless_megatron_prefixes_opens_them(tmp_path):
    """Megatron's --data-path names prefixes without .bin/.idx; a glob of them does too."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        with IndexedWriter(str(tmp_path / name / "shard-00000"), np.uint16) as w:
            w.add_document(np.arange(10, dtype=np.uint16))
    ds = open_dataset(str(tmp_path / "*" / "shard-00000"))
    assert ds.num_tokens == 20 and ds.documents == 2
    with pytest.raises(MscaleError, match="no file matches"):
        open_dataset(str(tmp_path / "*" / "shard-00001"))


@pytest.mark.parametrize("name", ["tokenizer.json", "plan.yaml", "corpus.txt", "docs.jsonl"])
def test_a_text_or_config_file_is_not_read_as_flat_tokens(tmp_path, name):
    """`data inspect tokenizer.json` counted its bytes as 1,804 uint16 tokens, exit 0."""
    f = tmp_path / name
    f.write_text('{"model": {"type": "BPE"}}\n' * 8)
    with pytest.raises(MscaleError, match="is not token data") as e:
        open_dataset(str(f))
    assert e.value.file == str(f) and "mscale data prepare" in e.value.fix


def test_a_manifest_named_instead_of_its_folder_says_to_name_the_folder(tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    with pytest.raises(MscaleError, match="prepared folder's manifest") as e:
        open_dataset(str(folder / "manifest.json"))
    assert e.value.fix == f"name the folder: {folder}"
