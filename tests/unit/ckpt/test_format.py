"""Chunked shard files: round trips, partial reads, and corruption caught on read."""

from __future__ import annotations

import io

import pytest
import torch

from mscale.ckpt.format import ChunkError, Decoder, Encoder, shard_checksum, write_slice
from mscale.ckpt.manifest import SliceInfo


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor, without a copy."""
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _write(t: torch.Tensor, codec: str, chunk: int):
    buf = io.BytesIO()
    table = write_slice(buf, Encoder(codec, 3, chunk), tensor_bytes(t))
    s = SliceInfo(tensor="x", box=[[0, t.numel()]], flat=[0, t.numel()], offset=0, chunks=table)
    return buf, s


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_reads_match_the_tensor(codec, dtype):
    t = torch.randn(1000).to(getattr(torch, dtype))
    buf, s = _write(t, codec, 128)
    assert len(s.chunks) == -(-t.numel() * t.element_size() // 128)
    dec = Decoder(codec, 128)
    for lo, hi in [(0, 1000), (0, 1), (31, 33), (500, 999), (999, 1000), (17, 17 + 64)]:
        assert torch.equal(dec.read(buf, s, dtype, lo, hi), t[lo:hi])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_flipped_byte_is_caught_and_named(codec):
    t = torch.arange(256, dtype=torch.float32)
    buf, s = _write(t, codec, 256)
    data = bytearray(buf.getvalue())
    data[300] ^= 0x01
    with pytest.raises(ChunkError, match="chunk 1: checksum mismatch"):
        Decoder(codec, 256).read(io.BytesIO(bytes(data)), s, "float32", 0, 256, where="f")
    assert torch.equal(Decoder(codec, 256).read(io.BytesIO(bytes(data)), s, "float32", 0, 60),
                       t[:60])  # other chunks stay readable


def test_truncated_file_is_caught():
    t = torch.arange(64, dtype=torch.float32)
    buf, s = _write(t, "raw", 64)
    short = io.BytesIO(buf.getvalue()[:-10])
    with pytest.raises(ChunkError, match="ends 10 bytes early"):
        Decoder("raw", 64).read(short, s, "float32", 0, 64)


def test_shard_checksum_depends_on_every_chunk():
    assert shard_checksum([1, 2]) != shard_checksum([2, 1])
    assert shard_checksum([1, 2]).startswith("crc32-chunks:")


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_whole_slice_reads_in_place_and_checks(codec):
    t = torch.randn(300)
    buf, s = _write(t, codec, 256)
    out = torch.empty(300)
    Decoder(codec, 256).read_whole(buf, s, out)
    assert torch.equal(out, t)
    data = bytearray(buf.getvalue())
    data[-3] ^= 0x80
    with pytest.raises(ChunkError, match="checksum mismatch"):
        Decoder(codec, 256).read_whole(io.BytesIO(bytes(data)), s, torch.empty(300))


def test_element_sizes_of_the_torch_free_schema_are_torchs():
    import torch

    from mscale.ckpt.manifest import ELEMENT_SIZES

    assert {n: torch.empty((), dtype=getattr(torch, n)).element_size()
            for n in ELEMENT_SIZES} == ELEMENT_SIZES
