"""bench_data.py's section 3, remote: the sources served by ``slowmem://`` (fsspec's in-memory
filesystem with a latency slept in every range read) and read by `DataLoader` behind a fake step:
the share of the step spent waiting, without read-ahead and with it. torch and pydantic are
imported where they are used (bench_data.py's module comment says why).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
from fsspec.implementations.memory import MemoryFileSystem

from bench_data_loader import SEED, data_config
from bench_data_prepare import VOCAB
from mscale.data import storage
from mscale.data.datasets import open_dataset
from mscale.data.indexed import IndexedWriter


class SlowMemoryFileSystem(MemoryFileSystem):
    """``memory://`` with ``latency_s`` slept in every ``cat_file`` (a store's first-byte time);
    counts the range reads and their bytes. Shares memory://'s store."""

    protocol = ("slowmem",)
    latency_s = 0.02
    reads = 0
    read_bytes = 0
    read_s = 0.0
    _count_lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str):
            path = path.removeprefix("slowmem://")
        return MemoryFileSystem._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        t0 = time.perf_counter()
        time.sleep(self.latency_s)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with self._count_lock:
            SlowMemoryFileSystem.reads += 1
            SlowMemoryFileSystem.read_bytes += len(data)
            SlowMemoryFileSystem.read_s += time.perf_counter() - t0
        return data


def upload(local: str, url: str) -> None:
    """Copy a local file or a folder's files into the in-memory store under ``url``."""
    fs = fsspec.filesystem("slowmem")
    names = sorted(os.listdir(local)) if os.path.isdir(local) else [None]
    for name in names:
        src = os.path.join(local, name) if name else local
        fs.pipe_file(f"{url}/{name}" if name else url, Path(src).read_bytes())


def make_big(tmp: str, mib: int) -> str:
    """A Megatron prefix of about ``mib`` MiB: the stdlib tokens' documents, repeated."""
    ds = open_dataset(f"{tmp}/tokens-w1")
    tokens = ds.read(0, ds.num_tokens).astype(np.uint16)
    lengths = np.diff(ds.document_starts())
    reps = max(1, (mib << 20) // tokens.nbytes)
    prefix = f"{tmp}/big/corpus"
    with IndexedWriter(prefix, "uint16") as w:
        for _ in range(reps):
            w.add_documents(tokens, lengths)
    return prefix


class Counted:
    """A token source that counts the samples read (by the training or the read-ahead thread)."""

    def __init__(self, source):
        self.source, self.seq_len = source, source.seq_len
        self.read_threads = source.read_threads  # what the loader would use for this source
        self.samples_read, self.lock = 0, threading.Lock()

    def batch(self, ks):
        out = self.source.batch(ks)  # the read-ahead threads read in parallel: no lock around it
        with self.lock:
            self.samples_read += len(ks)
        return out


def wait_share(paths: list[str], shape: dict, read_ahead: int, steps: int,
               step_s: float) -> dict:
    """Steps of ``step_s`` (slept, spread over the micro-batches) reading through a DataLoader:
    the share of the step's wall time spent in ``loader.get``. Step 0 (the cold reads, the
    read-ahead thread's start) is reported apart."""
    from mscale.train.data import BatchPlan, DataLoader, make_sources

    seq, mb, gb = shape["seq_len"], shape["micro_batch"], shape["global_batch"]
    source = Counted(make_sources(data_config(paths), SEED, seq, VOCAB)[0])
    plan = BatchPlan(gb, mb, 1, 0)
    reads0, read_s0 = SlowMemoryFileSystem.reads, SlowMemoryFileSystem.read_s
    loader = DataLoader(source, plan, read_ahead=read_ahead)
    m = plan.micro_batches
    waits, cpus, walls, first = [], [], [], None
    try:
        for step in range(steps + 1):
            wait = cpu = 0.0
            t_step = time.perf_counter()
            for j in range(m):
                t0, c0 = time.perf_counter(), time.thread_time()
                loader.get(step, j)
                wait += time.perf_counter() - t0
                cpu += time.thread_time() - c0
                time.sleep(step_s / m)
            wall = time.perf_counter() - t_step
            if step == 0:
                first = (wait, wall)
            else:
                waits.append(wait)
                cpus.append(cpu)
                walls.append(wall)
    finally:
        loader.close()
    with source.lock:  # the read-ahead thread may be in a read: count what is done
        reads, samples = SlowMemoryFileSystem.reads - reads0, source.samples_read
        read_s = SlowMemoryFileSystem.read_s - read_s0
    return {"read_ahead": read_ahead, "steps": steps, "micro_batches": m,
            "wait_share": round(sum(waits) / sum(walls), 4),
            "wait_ms_per_step": round(statistics.median(waits) * 1e3, 1),
            "max_wait_ms": round(max(waits) * 1e3, 1),
            "get_cpu_ms_per_step": round(statistics.median(cpus) * 1e3, 1),
            "fetch_ms_per_step": round(read_s / samples * gb * 1e3, 1),
            "step_ms": round(statistics.median(walls) * 1e3, 1),
            "first_step_wait_ms": round(first[0] * 1e3, 1),
            "range_reads_per_sample": round(reads / samples, 3)}


def bench_remote(args, tmp: str, shape: dict) -> dict:
    fsspec.register_implementation("slowmem", SlowMemoryFileSystem, clobber=True)
    SlowMemoryFileSystem.latency_s = args.latency_ms / 1e3
    root = f"slowmem://bench-data-{os.getpid()}"
    step_s = args.step_s or (0.2 if args.remote_shape == "demo" else args.gpu_step_s)
    shape = {**shape, "step_s": step_s}
    micro = shape["global_batch"] // shape["micro_batch"]
    res = {"latency_ms": args.latency_ms, "step_s": step_s, "micro_batches": micro,
           "shape": args.remote_shape, "seq_len": shape["seq_len"],
           "micro_batch": shape["micro_batch"],
           "block_mib": storage.open_blob.__kwdefaults__["block_bytes"] / 2**20,
           "cache_mib": storage.CACHE_BYTES / 2**20, "cases": {}}
    try:
        upload(f"{tmp}/tokens-w1", f"{root}/a")
        upload(f"{tmp}/tokens-w2", f"{root}/b")
        small = [f"{root}/a", f"{root}/b"]
        res["small_bin_mib"] = round(os.path.getsize(f"{tmp}/tokens-w1/shard-00000.bin")
                                     / 2**20, 2)
        cases = [("local", [f"{tmp}/tokens-w1", f"{tmp}/tokens-w2"]), ("stdlib", small)]
        if args.big_mib:
            prefix = make_big(tmp, args.big_mib)
            for name in ("a", "b"):
                for ext in (".bin", ".idx"):
                    upload(prefix + ext, f"{root}/big-{name}{ext}")
            os.remove(prefix + ".bin")
            res["big_bin_mib"] = round(
                fsspec.filesystem("slowmem").size(f"{root}/big-a.bin") / 2**20, 1)
            cases.append(("big", [f"{root}/big-a", f"{root}/big-b"]))
        for name, paths in cases:
            res["cases"][name] = [wait_share(paths, shape, ra, args.steps, step_s)
                                  for ra in (0, 2)]
    finally:
        fs = fsspec.filesystem("slowmem")
        if fs.exists(root):
            fs.rm(root, recursive=True)
    return res
