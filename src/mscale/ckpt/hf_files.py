"""Which ``*.safetensors`` files of an HF folder an import reads, and which tensor from which.

A sharded HF model (``model-0000N-of-0000M.safetensors``) comes with
``model.safetensors.index.json``, whose ``weight_map`` maps every tensor name to the file that
holds it. As huggingface transformers does, when the index is there it is the model: the files
it lists are the ones read, each tensor is taken from the file it names, and a ``*.safetensors``
beside them that it does not list (a stale shard of an earlier export, a copy kept aside) is not
read. A listed file that is missing, or a file that does not hold a tensor the index maps to it,
is bad input naming both. Without an index every ``*.safetensors`` of the folder is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mscale.ckpt import catalog
from mscale.config.files import read_bytes
from mscale.config.json_reader import parse_json
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.runs.atomic import fs_and_path

INDEX = "model.safetensors.index.json"
"""The index of a sharded HF model (transformers' ``SAFE_WEIGHTS_INDEX_NAME``)."""

_FIX = (f"give the {INDEX} that `save_pretrained` wrote with these files, or remove it to "
        "read every *.safetensors of the folder")


@dataclass
class HFFiles:
    """What an import of one HF folder reads."""

    files: list[str]
    """The safetensors files to read (URLs or paths), in name order."""
    weight_map: dict[str, str] | None = None
    """Tensor name -> file name, from the index; None without one (every file read whole)."""
    not_read: list[str] = field(default_factory=list)
    """``*.safetensors`` names in the folder that the index does not list: not read."""


def hf_files(path: str) -> HFFiles:
    """The files to read from the HF folder ``path``: those its index lists (each checked to
    exist) or, without an index, every ``*.safetensors`` in it."""
    fs, root = fs_and_path(path)
    present = sorted(catalog.basename(p) for p in fs.ls(root, detail=False)
                     if p.endswith(".safetensors"))
    index = catalog.join(path, INDEX)
    if not fs.exists(fs_and_path(index)[1]):
        return HFFiles([catalog.join(path, n) for n in present])
    weight_map = read_index(index)
    listed = sorted(set(weight_map.values()))
    for name in listed:
        if name not in present:
            tensor = next(t for t, f in weight_map.items() if f == name)
            raise MscaleError(f"lists {name} (for {tensor} and others), which is not in the "
                              "folder", file=index, field=f"weight_map.{tensor}",
                              code=EXIT_BAD_INPUT,
                              fix=f"copy {name} beside the index (every file it lists is read)")
    return HFFiles([catalog.join(path, n) for n in listed], weight_map,
                   [n for n in present if n not in listed])


def read_index(url: str) -> dict[str, str]:
    """The ``weight_map`` of an index file, read bounded as UTF-8 JSON; every file it names
    must be a plain file name in the folder (no ``/``, ``..``): a path that leaves the folder
    is refused, never opened."""
    data = parse_json(read_bytes(url), url, what=INDEX, code=EXIT_BAD_INPUT, fix=_FIX)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise MscaleError("has no weight_map (an object of tensor name -> file name)", file=url,
                          field="weight_map", code=EXIT_BAD_INPUT, fix=_FIX)
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not _plain_name(name):
            raise MscaleError(f"maps {tensor} to {name!r}, not a file name in the folder",
                              file=url, field=f"weight_map.{tensor}", code=EXIT_BAD_INPUT,
                              fix="the index names files beside it (model-00001-of-00002."
                                  "safetensors), never a path")
    return weight_map


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def check_mapped(entries, path: str, weight_map: dict[str, str] | None) -> list:
    """The header ``entries`` of file ``path`` to read: with an index, the tensors it maps to
    this file, each of which the file must hold (an error names the file and the tensor), and
    those it maps nowhere (transformers loads a listed file whole); not a copy of a tensor it
    maps to another file. Without an index, all of them."""
    if weight_map is None:
        return list(entries)
    name = catalog.basename(path)
    held = {e.name for e in entries}
    for tensor, where in weight_map.items():
        if where == name and tensor not in held:
            raise MscaleError(f"does not hold {tensor}, which {INDEX} maps to it", file=path,
                              field=tensor, code=EXIT_BAD_INPUT,
                              fix=f"use the files and the {INDEX} of one save_pretrained (an "
                                  "index of another save names other files' contents)")
    return [e for e in entries if weight_map.get(e.name, name) == name]
