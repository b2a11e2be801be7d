"""storage: local memory-mapped reads, remote range reads through the block cache, retries,
timeouts that never hang, and spec expansion."""

from __future__ import annotations

import threading

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from mscale.data import storage
from mscale.data.storage import Retry, expand, kind, open_blob
from mscale.errors import MscaleError

DATA = bytes(range(256)) * 40  # 10,240 bytes, every offset distinguishable modulo 256


class FlakyFS(MemoryFileSystem):
    """A memory filesystem whose range reads fail ``fail`` times, or hang, as a test sets.

    Shares MemoryFileSystem's class-level store, so files written through memory:// are here.
    """

    protocol = "flaky"
    fail = 0
    hang = False
    calls = 0
    release = threading.Event()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("flaky://"))

    def cat_file(self, path, start=None, end=None, **kw):
        type(self).calls += 1
        if type(self).hang:
            type(self).release.wait(5)
        if type(self).fail > 0:
            type(self).fail -= 1
            raise ConnectionResetError("connection reset by peer")
        return super().cat_file(path, start=start, end=end, **kw)


fsspec.register_implementation("flaky", FlakyFS, clobber=True)


@pytest.fixture
def remote():
    """A 10 KiB file on memory:// (also visible as flaky://), counters reset."""
    fs = fsspec.filesystem("memory")
    fs.pipe("/storage-test/blob.bin", DATA)
    FlakyFS.fail, FlakyFS.hang, FlakyFS.calls = 0, False, 0
    FlakyFS.release.clear()
    yield "storage-test/blob.bin"
    FlakyFS.release.set()  # let a hung worker thread finish
    fs.rm("/storage-test", recursive=True)


def test_local_read_is_a_slice(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(DATA)
    blob = open_blob(str(path))
    assert blob.size == len(DATA)
    assert blob.read(0, 10) == DATA[:10]
    assert blob.read(1000, 3000) == DATA[1000:4000]
    assert blob.read(len(DATA), 0) == b""


def test_local_empty_file_and_out_of_range(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert open_blob(str(tmp_path / "empty")).read(0, 0) == b""
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(MscaleError, match="outside the file") as e:
        open_blob(str(tmp_path / "f")).read(2, 5)
    assert e.value.file == str(tmp_path / "f")


def test_missing_local_file_names_it(tmp_path):
    with pytest.raises(MscaleError, match="no such file") as e:
        open_blob(str(tmp_path / "nope.bin"))
    assert e.value.file == str(tmp_path / "nope.bin")


def test_memory_read(remote):
    blob = open_blob("memory://" + remote, block_bytes=1024)
    assert blob.size == len(DATA)
    assert blob.read(1000, 3000) == DATA[1000:4000]  # spans four blocks
    assert blob.read(len(DATA) - 5, 5) == DATA[-5:]  # the short last block


def test_missing_remote_file_is_not_retried(remote):
    with pytest.raises(MscaleError, match="no such file") as e:
        open_blob("flaky://storage-test/other.bin", retry=Retry(3, backoff_s=0))
    assert e.value.file == "flaky://storage-test/other.bin"


def test_block_cache_serves_consecutive_reads(remote, monkeypatch):
    monkeypatch.setattr(storage, "CACHE_BYTES", 4 * 1024)  # four of these blocks
    blob = open_blob("flaky://" + remote, block_bytes=1024)
    for offset in range(0, 1024, 64):  # sixteen samples in one block: one request
        assert blob.read(offset, 64) == DATA[offset:offset + 64]
    assert FlakyFS.calls == 1
    assert blob.read(1000, 100) == DATA[1000:1100]  # crosses into block 1: one more
    assert FlakyFS.calls == 2
    for b in range(2, 6):  # evicts blocks 0 and 1 (LRU)
        blob.read(b * 1024, 1)
    calls = FlakyFS.calls
    blob.read(0, 1)
    assert FlakyFS.calls == calls + 1


def test_transient_failures_are_retried(remote):
    FlakyFS.fail = 2
    blob = open_blob("flaky://" + remote, retry=Retry(4, backoff_s=0.001))
    assert blob.read(5, 10) == DATA[5:15]
    assert FlakyFS.calls == 3


def test_persistent_failure_is_one_clear_error(remote):
    FlakyFS.fail = 10**6
    blob = open_blob("flaky://" + remote, retry=Retry(2, backoff_s=0.001), block_bytes=1024)
    with pytest.raises(MscaleError) as e:
        blob.read(0, 10)
    text = str(e.value)
    assert "after 3 attempts" in text and "ConnectionResetError" in text
    assert e.value.file == "flaky://" + remote and e.value.field == "bytes[0:1024]"
    assert e.value.code == 3 and FlakyFS.calls == 3
    # the field once: "URL: bytes[0:1024]: bytes[0:1024] failed after ..." said it twice
    assert text.count("bytes[0:1024]") == 1


def test_one_attempt_is_said_in_the_singular(remote):
    """data.remote_retry_s: 0 (no retry) said "failed after 1 attempts"."""
    FlakyFS.fail = 10**6
    blob = open_blob("flaky://" + remote, retry=Retry.within(0), block_bytes=1024)
    with pytest.raises(MscaleError, match=r"failed after 1 attempt \(timeout 60 s each\)"):
        blob.read(0, 10)


def test_a_hanging_store_times_out(remote):
    FlakyFS.hang = True
    blob = open_blob("flaky://" + remote, retry=Retry(1, backoff_s=0.001, timeout_s=0.05))
    with pytest.raises(MscaleError, match=r"after 2 attempts \(timeout 0.05 s each\).*Timeout"):
        blob.read(0, 10)


def test_concurrent_readers_agree(remote):
    blob = open_blob("flaky://" + remote, block_bytes=512)
    bad: list[int] = []

    def reader(seed: int) -> None:
        for i in range(50):
            offset = (seed * 997 + i * 131) % (len(DATA) - 300)
            if blob.read(offset, 300) != DATA[offset:offset + 300]:
                bad.append(offset)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_expand_local(tmp_path):
    for name in ("b.idx", "a.bin", "a.idx"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    files = [str(tmp_path / n) for n in ("a.bin", "a.idx", "b.idx")]
    assert expand(str(tmp_path)) == files  # folder: its files, sorted, no subfolders
    assert expand(str(tmp_path / "*.idx")) == files[1:]
    assert expand(str(tmp_path / "a.bin")) == files[:1]
    with pytest.raises(MscaleError, match="no file matches") as e:
        expand(str(tmp_path / "*.json"))
    assert e.value.file == str(tmp_path / "*.json")
    with pytest.raises(MscaleError, match="no file matches"):
        expand(str(tmp_path / "missing"))
    with pytest.raises(MscaleError, match="only folder") as e:  # `data/cod*` for data/code
        expand(str(tmp_path / "su*"))
    assert e.value.fix.startswith(f"name the folder itself ({tmp_path / 'sub'})")


def test_expand_keeps_the_protocol(remote):
    fsspec.filesystem("memory").pipe("/storage-test/c.idx", b"x")
    assert expand("memory://storage-test/*.idx") == ["memory:///storage-test/c.idx"]
    assert expand("memory://storage-test") == ["memory:///storage-test/blob.bin",
                                               "memory:///storage-test/c.idx"]
    assert kind("memory://storage-test") == "dir"
    assert kind("memory://storage-test/c.idx") == "file"
    assert kind("memory://storage-test/none") is None


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    """Opening a FIFO with no writer blocks forever: it must be refused from its stat alone."""
    import os

    fifo = tmp_path / "tokens.bin"
    os.mkfifo(fifo)
    with pytest.raises(MscaleError, match="not a regular file") as e:
        open_blob(str(fifo))
    assert e.value.file == str(fifo)


def test_the_block_cache_is_one_budget_for_every_file_the_process_reads(remote, monkeypatch):
    """Shuffled reads touch a new block of some shard almost every sample; a cache per file grew
    with the shard count (16 MiB each: ~58 GiB for a trillion tokens' 3,700 shards)."""
    monkeypatch.setattr(storage, "CACHE_BYTES", 8 * 1024)
    blobs = [open_blob("flaky://" + remote, block_bytes=1024) for _ in range(6)]
    for blob in blobs:  # two blocks each, 12 in all
        blob.read(0, 1)
        blob.read(1024, 1)
    assert storage._CACHE._bytes <= 8 * 1024
    calls = FlakyFS.calls
    blobs[-1].read(1024, 1)  # the newest are kept
    assert FlakyFS.calls == calls
    blobs[0].read(0, 1)  # the oldest went
    assert FlakyFS.calls == calls + 1


def test_retry_within_a_patience_and_the_default_it_sets(monkeypatch):
    assert Retry.within(7.5).retries == 4  # 0.5 + 1 + 2 + 4: the default
    assert [Retry.within(p).retries for p in (0, 0.4, 120, 600)] == [0, 0, 8, 24]
    assert Retry.within(86400).retries == 2884  # the field's maximum: 6 doubling, then 30 s each
    r = Retry.within(600)
    assert max(r.wait(i) for i in range(1, r.retries + 1)) == 30  # each wait capped
    assert sum(r.wait(i) for i in range(1, r.retries + 1)) <= 600
    monkeypatch.setattr(storage, "_default", storage._default)  # restored after the test
    storage.set_default_retry(Retry(0, timeout_s=0.05))
    fs = fsspec.filesystem("memory")
    fs.pipe("/storage-test/patience.bin", b"x" * 10)
    blob = open_blob("memory://storage-test/patience.bin")
    assert blob._retry.retries == 0 and blob._retry.timeout_s == 0.05
