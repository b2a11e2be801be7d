"""ckpt/hf_files.py: an HF import honours model.safetensors.index.json as transformers does:
the files its weight_map lists are read, each tensor from the file it names; a stray
*.safetensors is not read (and the start line says so); a listed file that is missing, a file
that lacks a tensor mapped to it, or a name that leaves the folder is bad input naming them."""

from __future__ import annotations

import json

import pytest
import torch

from mscale.ckpt import catalog, safetensors
from mscale.ckpt.convert import convert, open_hf
from mscale.ckpt.hf_files import INDEX
from mscale.ckpt.load import CheckpointReader
from mscale.config.base import dump_yaml
from mscale.errors import MscaleError
from tests.unit.ckpt.test_hf import exported_hf

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _write(path, tensors: dict) -> None:
    with open(path, "wb") as fh:
        safetensors.write(fh, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                          tensors.__getitem__)


@pytest.fixture
def sharded(tmp_path):
    """The export split in two files with an index, as save_pretrained shards a large model;
    the second file also holds a zeroed copy of the first file's first tensor, which the index
    does not map there. Returns (HF folder, plan file, weights by checkpoint key, that name)."""
    p, weights = exported_hf(tmp_path)
    hf = tmp_path / "hf"
    _, tensors = open_hf(str(hf))
    tensors = {k: v.clone() for k, v in tensors.items()}
    names = list(tensors)
    half = len(names) // 2
    _write(hf / FIRST, {k: tensors[k] for k in names[:half]})
    _write(hf / SECOND, {**{k: tensors[k] for k in names[half:]},
                         names[0]: torch.zeros_like(tensors[names[0]])})
    (hf / "model.safetensors").unlink()
    weight_map = {k: FIRST if i < half else SECOND for i, k in enumerate(names)}
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "plan.yaml").write_text(dump_yaml(p))
    return hf, str(tmp_path / "plan.yaml"), weights, names[0]


def _imported(dst, weights) -> None:
    m = catalog.load_committed(str(dst))
    with CheckpointReader(str(dst), m) as r:
        for k, v in weights.items():
            assert torch.equal(r.read_full(k), v), k


def test_the_index_chooses_the_files_and_the_file_of_each_tensor(sharded, tmp_path, cli):
    """The index was ignored: every *.safetensors was read, so a stray file beside a sharded
    model was read too (refused as "two files hold it", or its extra tensors taken)."""
    hf, plan, weights, doubled = sharded
    _write(hf / "zz-old.safetensors", {doubled: torch.ones(1)})  # a stray file, not listed
    started = []
    dst = tmp_path / "out"
    done = convert(str(hf), str(dst), plan=plan, on_start=started.append)
    _imported(dst, weights)  # the doubled tensor from FIRST, as mapped, not SECOND's zeros
    assert started[0]["not_read"] == ["zz-old.safetensors"]
    assert done["not_read"] == ["zz-old.safetensors"]
    code, _, err = cli("ckpt", "convert", str(hf), str(tmp_path / "again"), "--plan", plan)
    assert code == 0
    assert f"; not read, not in {INDEX}: zz-old.safetensors" in err.splitlines()[0]


def test_a_tensor_of_a_listed_file_the_index_leaves_out_is_still_read(sharded, tmp_path):
    """transformers loads a listed file whole: a weight the weight_map omits is not missing."""
    hf, plan, weights, doubled = sharded
    index = json.loads((hf / INDEX).read_text())
    left_out = next(k for k, f in index["weight_map"].items() if f == FIRST and k != doubled)
    del index["weight_map"][left_out]
    (hf / INDEX).write_text(json.dumps(index))
    convert(str(hf), str(tmp_path / "out"), plan=plan)
    _imported(tmp_path / "out", weights)


def test_a_file_the_index_lists_that_is_missing_is_named(sharded, tmp_path):
    hf, plan, _, _ = sharded
    (hf / SECOND).unlink()
    started = []
    with pytest.raises(MscaleError) as e:
        convert(str(hf), str(tmp_path / "out"), plan=plan, on_start=started.append)
    assert e.value.code == 3 and e.value.file.endswith(INDEX)
    assert SECOND in e.value.message and e.value.field.startswith("weight_map.model.")
    assert started == [] and not (tmp_path / "out").exists()


def test_a_tensor_mapped_to_a_file_that_lacks_it_is_named(sharded, tmp_path):
    hf, plan, _, _ = sharded
    index = json.loads((hf / INDEX).read_text())
    moved = next(k for k, f in index["weight_map"].items() if f == SECOND)
    index["weight_map"][moved] = FIRST
    (hf / INDEX).write_text(json.dumps(index))
    with pytest.raises(MscaleError) as e:
        convert(str(hf), str(tmp_path / "out"), plan=plan)
    assert e.value.code == 3 and e.value.file.endswith(FIRST) and e.value.field == moved
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../model.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_an_index_naming_a_path_outside_the_folder_is_refused(sharded, tmp_path, name):
    hf, plan, _, doubled = sharded
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"][doubled] = name
    (hf / INDEX).write_text(json.dumps(index))
    with pytest.raises(MscaleError) as e:
        open_hf(str(hf))
    assert e.value.code == 3 and e.value.field == f"weight_map.{doubled}"
    assert "not a file name in the folder" in e.value.message
