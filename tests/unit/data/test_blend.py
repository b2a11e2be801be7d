"""mscale.data.blend: a source that names nothing is the field's error; a relative path says
it was taken from the current directory, and which one."""

from __future__ import annotations

import numpy as np
import pytest

from mscale.config.training import DataConfig
from mscale.data.blend import build_splits, open_sources
from mscale.data.datasets import open_dataset
from mscale.errors import MscaleError
from tests.unit.data.folders import prepared


def test_a_missing_relative_source_names_the_current_directory_and_the_fix(tmp_path,
                                                                           monkeypatch):
    """From another directory, the plan's `runs/demo-text-data/tokens` said only "check the
    path": the user could not tell it had been looked for under the current directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MscaleError) as e:
        open_sources(DataConfig(kind="tokens", path="runs/demo/tokens"))
    assert e.value.field == "training.data.path" and e.value.file is None  # the plan's, if known
    assert e.value.message.startswith("runs/demo/tokens: no such file")
    assert f"current directory ({tmp_path})" in e.value.message
    assert str(tmp_path / "runs" / "demo" / "tokens") in e.value.message
    assert "absolute path in training.data.path" in e.value.fix
    assert "directory the plan's data paths are relative to" in e.value.fix
    # run from the right directory before the data exist, the fix says how to make them
    assert ("mscale data prepare INPUT... --tokenizer TOKENIZER --out runs/demo/tokens"
            in e.value.fix)


def test_a_missing_blend_source_names_its_own_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(kind="tokens", sources=[{"path": str(tmp_path / "gone")},
                                             {"path": "b/tokens"}])
    with pytest.raises(MscaleError) as e:
        open_sources(cfg)
    assert e.value.field == "training.data.sources[0].path"
    assert "relative" not in e.value.message and e.value.fix == "check the path"  # absolute


def test_open_dataset_says_where_a_relative_spec_was_looked_for(tmp_path, monkeypatch):
    """`data inspect runs/x` from the wrong directory: the same words, no plan involved."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MscaleError) as e:
        open_dataset("runs/x")
    assert e.value.file == "runs/x" and str(tmp_path / "runs" / "x") in e.value.message
    assert "absolute path" in e.value.fix


def test_an_id_past_the_vocabulary_beyond_the_first_mib_is_bad_input_naming_the_source(tmp_path):
    """Open checks the first MiB of ids; one further in reached the embedding and stopped the
    rank with torch's bare `IndexError: index out of range in self`, classed as a crash."""
    ids = np.full((1 << 20) + 4096, 7, dtype=np.uint16)
    ids[(1 << 20) + 100:] = 60000  # a flat file's tail written by another tokenizer
    ids.tofile(tmp_path / "t.bin")
    train, _ = build_splits(DataConfig(path=str(tmp_path / "t.bin"), shuffle=False), 63, 1, 512)
    assert train.samples(list(range(16))).max() == 7  # the head reads as before
    with pytest.raises(MscaleError) as e:
        train.samples([(1 << 20) // 63 + 1])
    assert e.value.file == str(tmp_path / "t.bin") and e.value.field == "training.data.path"
    assert "token id 60000 >= the model's vocab 512" in e.value.message
    assert "tokenizer" in e.value.fix


def test_a_negative_id_is_bad_input_at_open_and_when_its_sample_is_read(tmp_path):
    """An int32 dataset holds -1 (a tokenizer's pad id): the checks looked at the largest id
    only, and torch's embedding stopped the rank with a bare IndexError."""
    from mscale.data.indexed import IndexedWriter

    head = np.full((1 << 20) + 4096, 7, dtype=np.int64)
    tail = head.copy()
    head[100] = -1
    tail[(1 << 20) + 100] = -1
    for name, ids in (("head", head), ("tail", tail)):
        w = IndexedWriter(str(tmp_path / name), "int32")
        w.add_document(ids)
        w.close()
    with pytest.raises(MscaleError, match="token id -1 < 0"):
        build_splits(DataConfig(path=str(tmp_path / "head.bin"), shuffle=False), 63, 1, 512)
    train, _ = build_splits(DataConfig(path=str(tmp_path / "tail.bin"), shuffle=False), 63, 1,
                            512)
    assert train.samples(list(range(16))).min() == 7
    with pytest.raises(MscaleError) as e:
        train.samples([(1 << 20) // 63 + 1])
    assert "token id -1 < 0 in tokens" in e.value.message
    assert e.value.file == str(tmp_path / "tail.bin")


def test_a_damaged_index_read_for_the_held_out_cut_is_named_itself(tmp_path):
    """The error named the folder with "in this source (N tokens, M documents)", not the
    truncated `.idx`: the one file to restore."""
    prepared(tmp_path / "d", [list(range(1, 40))] * 10)
    idx = tmp_path / "d" / "shard-00000.idx"
    idx.write_bytes(idx.read_bytes()[:20])
    cfg = DataConfig(path=str(tmp_path / "d"), eval_fraction=0.3)
    with pytest.raises(MscaleError) as e:
        build_splits(cfg, 8, 1, 300)
    assert e.value.file == str(idx) and e.value.field == "idx.header"
    assert e.value.message.endswith("(named by training.data.path)")
    assert "in this source" not in e.value.message


@pytest.mark.parametrize("key, second", [("sources", "./web/"), ("sources", "{tmp}/web"),
                                         ("eval_sources", "held")])
def test_a_source_listed_twice_is_refused_naming_the_entry_and_both_fixes(tmp_path,
                                                                        monkeypatch, key, second):
    """A blend naming data/web twice trained with 'data: blend of 3 sources: data/web 33%,
    data/code 33%, data/web 33%': a typo for another source silently doubled one."""
    monkeypatch.chdir(tmp_path)
    for name in ("web", "code", "held"):
        prepared(tmp_path / name, [np.arange(1, 200)] * 4)
    first = "web" if key == "sources" else "held"
    listed = [{"path": first, "weight": 2}, {"path": "code"},
              {"path": second.format(tmp=tmp_path), "weight": 3}]
    cfg = (DataConfig(kind="tokens", sources=listed) if key == "sources" else
           DataConfig(kind="tokens", sources=[{"path": "web"}], eval_sources=listed))
    with pytest.raises(MscaleError) as e:
        open_sources(cfg)
    assert e.value.code == 3 and e.value.field == f"training.data.{key}[2].path"
    assert f"listed twice (also {key}[0]: {first})" in e.value.message
    assert "name the source you meant" in e.value.fix and "weight 5 (both summed" in e.value.fix
    assert "--allow-data-change" in e.value.fix
    listed[2]["path"] = "other"  # a different source is fine
    prepared(tmp_path / "other", [np.arange(1, 200)] * 4)
    cfg = (DataConfig(kind="tokens", sources=listed) if key == "sources" else
           DataConfig(kind="tokens", sources=[{"path": "web"}], eval_sources=listed))
    assert len(open_sources(cfg)) == (3 if key == "sources" else 4)


@pytest.mark.parametrize("other, key", [({"tokenizer_sha256": "b" * 64}, "eval_sources"),
                                        ({"vocab_size": 512}, "sources"),
                                        ({"eod_id": 2, "tokenizer_sha256": None}, "sources")])
def test_prepared_sources_of_two_tokenizers_are_refused_naming_the_second(tmp_path, other, key):
    """A blend of a folder prepared with a 1,024-id BPE and one prepared with a 300-id BPE
    trained: every id lay below model.vocab, so no check saw that an id meant other text."""
    same = {"tokenizer_sha256": "a" * 64}
    prepared(tmp_path / "web", [np.arange(1, 200)] * 4, **same)
    prepared(tmp_path / "code", [np.arange(1, 200)] * 4, **same)
    prepared(tmp_path / "odd", [np.arange(1, 200)] * 4, **{**same, **other})
    web, code, odd = (str(tmp_path / n) for n in ("web", "code", "odd"))
    listed = {"sources": [{"path": web}, {"path": code}]}
    assert build_splits(DataConfig(**listed), 8, 1, 512)[0] is not None  # one tokenizer: fine
    listed[key] = listed.get(key, []) + [{"path": odd}]
    with pytest.raises(MscaleError) as e:
        build_splits(DataConfig(**listed), 8, 1, 512)
    assert e.value.code == 3 and e.value.file == str(tmp_path / "odd" / "manifest.json")
    assert e.value.field == f"training.data.{key}[{len(listed[key]) - 1}].path"
    assert f"another tokenizer than {web} (training.data.sources[0].path)" in e.value.message
    assert f"--tokenizer TOKENIZER --out {odd} --force" in e.value.fix


def test_a_uint32_flat_file_read_at_the_uint16_default_is_refused_for_a_small_vocab(tmp_path):
    """nanoGPT-style uint32 ids of a 1,024-id model read at the uint16 default trained on every
    id followed by a 0: all below the vocabulary, so the vocabulary check passed it."""
    ids = (np.arange(4096, dtype=np.uint32) * 7) % 1000 + 1
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(MscaleError) as e:
        build_splits(DataConfig(path=str(tmp_path / "t.bin")), 63, 1, 1024)
    assert e.value.code == 3 and e.value.field == "training.data.path"
    assert e.value.file == str(tmp_path / "t.bin") and "it holds uint32 ids" in e.value.message
    assert "data.dtype: uint32" in e.value.fix
    for dtype in ("uint32", "uint16"):  # said either way, the file is read as said
        train, _ = build_splits(DataConfig(path=str(tmp_path / "t.bin"), dtype=dtype,
                                           shuffle=False), 63, 1, 1024)
        first = train.samples([0])[0]
        assert (first == ids[:64]).all() if dtype == "uint32" else not first[1::2].any()


def test_a_one_document_source_with_eval_fraction_says_one_document(tmp_path):
    prepared(tmp_path / "one", [np.arange(1, 400)])
    with pytest.raises(MscaleError) as e:
        build_splits(DataConfig(path=str(tmp_path / "one"), eval_fraction=0.1), 8, 1, 512)
    assert e.value.message.endswith("(399 tokens, 1 document)")  # not "1 documents"


def _resaved(tokenizer: str, out, pretty: bool) -> str:
    """The same tokenizer saved again: other bytes (whitespace), the same ids."""
    from tokenizers import Tokenizer

    Tokenizer.from_file(tokenizer).save(str(out), pretty=pretty)
    return str(out)


def test_one_tokenizer_re_saved_is_not_another_tokenizer(tmp_path, tokenizer, monkeypatch):
    """A tokenizer.json pretty-printed by a re-save (save_pretrained, another `tokenizers`
    version) has other bytes, so another sha256, and the same id for every token: two sources
    prepared with it, byte-identical shards, were refused as "prepared with another tokenizer"
    and told to re-prepare one. Compared by vocabulary now, from the manifest (vocab_sha256) or,
    in a manifest from before it, from the tokenizer file it names while it is unchanged."""
    from mscale.data import blend
    from mscale.data.tokenizer import (load_tokenizer, read_tokenizer, recorded_vocab_sha256,
                                       vocab_sha256)

    flat, pretty = _resaved(tokenizer, tmp_path / "flat.json", False), \
        _resaved(tokenizer, tmp_path / "pretty.json", True)
    shas = [read_tokenizer(t)[2] for t in (flat, pretty)]
    assert shas[0] != shas[1]
    vocab = vocab_sha256(load_tokenizer(tokenizer))
    for name, tok, sha in (("web", flat, shas[0]), ("code", pretty, shas[1])):
        prepared(tmp_path / name, [np.arange(1, 200)] * 4, tokenizer=tok, tokenizer_sha256=sha)
    prepared(tmp_path / "new", [np.arange(1, 200)] * 4, tokenizer_sha256="c" * 64,
             vocab_sha256=vocab)
    listed = {"sources": [{"path": str(tmp_path / n)} for n in ("web", "code", "new")]}
    read = []  # an old manifest's tokenizer file is read once per source, not per comparison
    monkeypatch.setattr(blend, "recorded_vocab_sha256",
                        lambda *a: read.append(a) or recorded_vocab_sha256(*a))
    assert build_splits(DataConfig(**listed), 8, 1, 512)[0] is not None
    assert sorted(r[0] for r in read) == sorted([flat, pretty])
    # another vocabulary of the same size and EOD is still another tokenizer
    prepared(tmp_path / "other", [np.arange(1, 200)] * 4, tokenizer_sha256="d" * 64,
             vocab_sha256="e" * 64)
    listed["sources"].append({"path": str(tmp_path / "other")})
    with pytest.raises(MscaleError, match="prepared with another tokenizer"):
        build_splits(DataConfig(**listed), 8, 1, 512)
    # an old manifest's tokenizer file changed since: its vocabulary is unknown, so refused
    listed["sources"].pop()
    (tmp_path / "pretty.json").write_text("{}")
    with pytest.raises(MscaleError, match="prepared with another tokenizer"):
        build_splits(DataConfig(**listed), 8, 1, 512)
