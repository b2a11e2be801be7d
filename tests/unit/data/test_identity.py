"""A source's identity (`TokenDataset.identity`): what a checkpoint records so that a resume
notices a source re-prepared or rewritten under it."""

import numpy as np

from mscale.data.datasets import open_dataset
from mscale.data.indexed import IDENTITY_EDGE_BYTES
from tests.unit.data.folders import prepared


def test_a_prepared_folder_is_identified_by_its_manifest_not_by_where_it_came_from(tmp_path):
    docs = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    prepared(tmp_path / "a", docs, inputs=["corpus-1"])
    first = open_dataset(str(tmp_path / "a")).identity()
    assert first["kind"] == "manifest" and first["tokens"] == 9 and first["documents"] == 3
    prepared(tmp_path / "a", docs, inputs=["elsewhere/corpus-1"], tokenizer="other/t.json")
    assert open_dataset(str(tmp_path / "a")).identity() == first  # the same tokens again
    prepared(tmp_path / "a", docs[:2])
    again = open_dataset(str(tmp_path / "a")).identity()
    assert again["digest"] != first["digest"] and again["documents"] == 2


def test_a_flat_file_is_identified_by_its_size_and_both_ends(tmp_path):
    n = IDENTITY_EDGE_BYTES * 2  # uint16: 4 MiB, the first and last MiB apart
    tokens = (np.arange(n) % 300).astype(np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    first = open_dataset(str(path)).identity()
    assert first["kind"] == "edges" and first["tokens"] == n and first["documents"] is None
    tokens[-1] += 1  # the last token: in the last MiB
    tokens.tofile(path)
    assert open_dataset(str(path)).identity()["digest"] != first["digest"]
    tokens[-1] -= 1
    tokens[n // 2] += 1  # the middle, outside both edges: not seen (documented)
    tokens.tofile(path)
    assert open_dataset(str(path)).identity() == first
