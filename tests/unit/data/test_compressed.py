"""Compressed corpus inputs (data/compressed.py): damage is one error naming the file; whole
files, of one zstd frame or several, read back exactly."""

import bz2
import gzip
import lzma

import pytest
import zstandard

from mscale.data.corpus import expand_inputs, iter_documents
from mscale.errors import MscaleError

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3000).encode()
COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
            ".zst": zstandard.ZstdCompressor().compress}


def documents(path) -> list[str]:
    return [text for text, _ in iter_documents(expand_inputs([str(path)]))]


@pytest.mark.parametrize("ext", COMPRESS)
def test_a_truncated_file_is_named_not_read_as_a_shorter_document(tmp_path, ext):
    """A truncated .txt.zst used to read as an empty document (exit 0), a .txt.gz as 'internal
    error: EOFError' naming no file (helper-42's trial)."""
    data = COMPRESS[ext](TEXT)
    path = tmp_path / f"a.txt{ext}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MscaleError, match="truncated or damaged") as e:
        documents(path)
    assert e.value.file == str(path) and "again" in e.value.fix


def test_a_truncated_jsonl_zst_is_named_as_truncated_not_as_a_bad_line(tmp_path):
    lines = b"".join(b'{"text": "document %d"}\n' % i for i in range(2000))
    data = COMPRESS[".zst"](lines)
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(data[: len(data) - 7])
    with pytest.raises(MscaleError, match="ends inside a zstd frame"):
        documents(path)


@pytest.mark.parametrize("ext", COMPRESS)
def test_a_whole_file_reads_back_exactly(tmp_path, ext):
    path = tmp_path / f"a.txt{ext}"
    path.write_bytes(COMPRESS[ext](TEXT))
    assert documents(path) == [TEXT.decode()]


def test_concatenated_zstd_frames_are_one_document(tmp_path):
    """pzstd and `cat a.zst b.zst` write several frames: all of them are the file."""
    path = tmp_path / "a.txt.zst"
    path.write_bytes(COMPRESS[".zst"](TEXT[:1000]) + COMPRESS[".zst"](TEXT[1000:]))
    assert documents(path) == [TEXT.decode()]


def test_lines_across_frames_and_chunks_are_kept_whole(tmp_path):
    lines = [b'{"text": "document %d"}\n' % i for i in range(5000)]
    blob = b"".join(lines)
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(COMPRESS[".zst"](blob[:30001]) + COMPRESS[".zst"](blob[30001:]))
    assert documents(path) == [f"document {i}" for i in range(5000)]


def test_garbage_named_zst_is_damage(tmp_path):
    path = tmp_path / "a.txt.zst"
    path.write_bytes(b"this is not zstd at all" * 10)
    with pytest.raises(MscaleError, match="truncated or damaged") as e:
        documents(path)
    assert e.value.file == str(path)
