"""Benchmark: the data path, from text to the micro-batches a step reads.

Prints figures (not a test; no pass/fail); docs/benchmarks.md "Data path" keeps the last run's.
Each figure has its reference measured in the same process:

1. prepare: `mscale.data.prepare.prepare` on the Python standard library's top-level ``.py``
   files with a 1,024-id byte-level BPE trained on them (`train_tokenizer`), ``workers`` 1 and 2,
   tokens/s in all and per worker process; reference: the `tokenizers` library's own
   ``encode_batch`` on the same texts (read beforehand), one thread and two. The ratio is what
   reading, batching, worker processes and writing the shards cost on top of the tokenizer.
2. loader: `DatasetTokens.batch` (`mscale.data.blend.build_splits`: two sources blended 3:1,
   shuffled, ``eval_fraction`` 0.01) for micro-batches shaped like the real-text demo's
   (``plans/cpu-text.yaml``) and like the 1B-on-one-H200 run's (``plans/gpu-1b-h200.yaml``),
   tokens/s; reference (the floor): ``np.memmap`` slicing of as many samples, at random sample
   starts, from one flat token file. Against what a step consumes: the demo's global batch per
   ``--demo-step-s``, the 1B run's per ``--gpu-step-s`` (docs/benchmarks.md, "GPU").
3. remote: the same sources served by ``slowmem://``, fsspec's in-memory filesystem with
   ``--latency-ms`` slept in every ``cat_file`` (every range read `storage.RemoteBlob` makes),
   read by `DataLoader` while a fake step sleeps ``--step-s`` over its micro-batches: the share
   of the step spent waiting in ``loader.get``, ``read_ahead`` 0 (the reference) against 2.
   Also from the local files (no latency: what reading itself costs the step), and from a
   source larger than `RemoteBlob`'s block cache (``--big-mib`` per source: the same tokens
   repeated), where shuffled samples rarely share a 4 MiB block, as on any real corpus.
   Demo-shaped micro-batches and a 0.2 s step by default; ``--remote-shape 1B`` for the 1B
   run's, with its step.

    .venv/bin/python bench/bench_data.py                  # ~2 min on 2 shared cores
    .venv/bin/python bench/bench_data.py --sections remote --remote-shape 1B --steps 6
    .venv/bin/python bench/bench_data.py --rounds 1 --json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import fsspec  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

from mscale.data import storage  # noqa: E402
from mscale.data.datasets import open_dataset  # noqa: E402
from mscale.data.indexed import IndexedWriter  # noqa: E402
from mscale.data.prepare import prepare  # noqa: E402
from mscale.data.tokenizer import train_tokenizer  # noqa: E402

# torch (mscale.train.data) and pydantic (mscale.config) are imported where they are used:
# prepare's worker processes start by importing this __main__ module, as spawn and forkserver
# children do, and the CLI's __main__ imports neither.

SEED, VOCAB = 1234, 1024


def command() -> str:
    exe = Path(sys.executable)
    shown = os.path.relpath(exe, Path.cwd()) if exe.is_relative_to(Path.cwd()) else str(exe)
    return shlex.join([shown, *sys.argv])


def machine() -> dict:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {"cores": cores, "load": [round(x, 2) for x in os.getloadavg()]}


def median_range(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


# --- 1. prepare ---------------------------------------------------------------------------

def encode_reference(tok_json: str, texts: list[str], threads: int) -> tuple[float, float, int]:
    """Seconds, CPU seconds of this process and tokens (EOD included, as prepare counts) of one
    ``encode_batch`` over all texts, on ``threads`` threads (tokenizers' own pool; 1:
    TOKENIZERS_PARALLELISM=false)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        encs = tok.encode_batch(texts, add_special_tokens=False)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    return dt, cpu, sum(len(e.ids) for e in encs) + len(texts)


def descendants_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every live descendant of this process, by pid, from
    /proc (Linux; {} elsewhere): prepare's worker processes are the forkserver's children, so
    this process's own rusage never sees them."""
    if not os.path.isdir("/proc/self"):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., utime (11), stime (12)
        parent[int(d)], cpu[int(d)] = int(rest[1]), (int(rest[11]) + int(rest[12])) / tick
    me, out = os.getpid(), {}
    for pid in cpu:
        p = parent.get(pid, 0)
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            out[pid] = cpu[pid]
    return out


def run_prepare(corpus: str, tokenizer: str, out: str, workers: int) -> dict:
    """One `prepare`: wall seconds, CPU seconds here and in the descendants (the workers, and
    the forkserver they are forked from), seconds until the first batch was written."""
    before = descendants_cpu()
    seen: dict[int, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    first = []

    def progress(documents, tokens, nbytes):
        if not first:
            first.append(time.perf_counter() - t0)
        for pid, c in descendants_cpu().items():  # before the pool's workers exit
            seen[pid] = max(seen.get(pid, 0.0), c)

    m = prepare([corpus], tokenizer, out, workers=workers, text_exts=[".py"], force=True,
                progress=progress)
    wall, here = time.perf_counter() - t0, time.process_time() - c0
    for pid, c in descendants_cpu().items():
        seen[pid] = max(seen.get(pid, 0.0), c)
    there = sum(c - before.get(pid, 0.0) for pid, c in seen.items())
    return {"s": wall, "cpu_here": here, "cpu_workers": there, "first": first[0],
            "tokens": m["tokens"], "documents": m["documents"]}


def bench_prepare(args, tmp: str) -> dict:
    corpus = sysconfig.get_paths()["stdlib"] + "/*.py"
    files = sorted(glob.glob(corpus))
    t0 = time.perf_counter()
    tok = train_tokenizer([corpus], VOCAB, f"{tmp}/tokenizer.json", text_exts=[".py"])
    train_s = time.perf_counter() - t0
    texts = [t for t in (Path(f).read_text(encoding="utf-8") for f in files) if t]
    tok_json = Path(tok["out"]).read_text(encoding="utf-8")
    runs: dict[str, list[dict]] = {"ref1": [], "ref2": [], "w1": [], "w2": []}
    for r in range(args.rounds):  # alternated, so drift on shared cores hits all alike
        for threads in (1, 2):
            dt, cpu, n = encode_reference(tok_json, texts, threads)
            runs[f"ref{threads}"].append({"s": dt, "cpu_here": cpu, "cpu_workers": 0.0,
                                          "tokens": n})
        for workers in (1, 2):
            runs[f"w{workers}"].append(run_prepare(corpus, f"{tmp}/tokenizer.json",
                                                   f"{tmp}/tokens-w{workers}", workers))
    counts = {key: {r["tokens"] for r in rs} for key, rs in runs.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(f"token counts differ between prepare and the reference: {counts}")
    n = runs["w1"][0]["tokens"]
    res = {"files": len(files), "documents": runs["w1"][0]["documents"],
           "text_bytes": tok["bytes"], "tokens": n, "tokenizer_train_s": round(train_s, 2),
           "rounds": args.rounds}
    for key, rs in runs.items():
        med, lo, hi = median_range([r["s"] for r in rs])
        cpu = statistics.median([r["cpu_here"] + r["cpu_workers"] for r in rs])
        res[key] = {"s": round(med, 3), "s_min": round(lo, 3), "s_max": round(hi, 3),
                    "tok_s": round(n / med), "cpu_s": round(cpu, 2),
                    "cpu_here_s": round(statistics.median([r["cpu_here"] for r in rs]), 2),
                    "tok_per_cpu_s": round(n / cpu)}
        if "first" in rs[0]:
            res[key]["first_batch_s"] = round(statistics.median([r["first"] for r in rs]), 2)
    for w in (1, 2):
        r = res[f"w{w}"]
        r["tok_s_per_worker"] = round(n / r["s"] / w)
        r["ratio_to_ref"] = round(res[f"ref{w}"]["s"] / r["s"], 3)
        r["cpu_ratio_to_ref"] = round(res["ref1"]["cpu_s"] / r["cpu_s"], 3)
    return res


# --- 2. loader ------------------------------------------------------------------------------

def shapes(args) -> dict[str, dict]:
    """seq_len and micro_batch of the demo's plan and of the 1B plan (defaults if missing)."""
    import yaml

    out = {}
    for name, plan, default in (("demo", "plans/cpu-text.yaml", (128, 2, 16)),
                                ("1B", "plans/gpu-1b-h200.yaml", (2048, 8, 16))):
        path = REPO / plan
        seq, mb, gb = default
        if path.is_file():
            p = yaml.safe_load(path.read_text())
            seq = p["model"]["seq_len"]
            mb = (p.get("layout") or {}).get("micro_batch") or p["training"]["micro_batch"]
            gb = p["training"]["global_batch"]
        else:
            plan = f"{plan} (missing: defaults)"
        if name == "demo":
            seq, mb = args.demo_seq or seq, args.demo_micro or mb
        step_s = args.demo_step_s if name == "demo" else args.gpu_step_s
        out[name] = {"plan": plan, "seq_len": seq, "micro_batch": mb, "global_batch": gb,
                     "step_s": step_s, "needed_tok_s": round(gb * seq / step_s)}
    return out


def data_config(paths: list[str]):
    from mscale.config.training import DataConfig

    return DataConfig(sources=[{"path": paths[0], "weight": 3}, {"path": paths[1], "weight": 1}],
                      eval_fraction=0.01)


def bench_loader(args, tmp: str, shape: dict) -> dict:
    import torch

    from mscale.train.data import make_sources

    seq, mb = shape["seq_len"], shape["micro_batch"]
    source, _ = make_sources(data_config([f"{tmp}/tokens-w1", f"{tmp}/tokens-w2"]), SEED, seq,
                             VOCAB)
    n = max(20, args.loader_tokens // (mb * seq))  # micro-batches per round
    flat = np.memmap(f"{tmp}/tokens-w1/shard-00000.bin", dtype="<u2", mode="r")
    count = (flat.size - 1) // seq
    rng = np.random.default_rng(SEED)
    ours, floor, index = [], [], []
    for r in range(args.rounds + 1):  # round 0 warms the page cache and the code paths
        starts = rng.integers(0, count, size=(n, mb)) * seq
        t0 = time.perf_counter()
        for i in range(n):
            rows = [flat[s:s + seq + 1] for s in starts[i]]
            torch.from_numpy(np.stack(rows).astype(np.int64))
        t1 = time.perf_counter()
        base = r * n * mb
        for i in range(n):
            source.batch(list(range(base + i * mb, base + (i + 1) * mb)))
        t2 = time.perf_counter()
        for i in range(n):  # the index maths alone: blend, shuffle, split (no token read)
            source.samples.mixture.locate(np.arange(base + i * mb, base + (i + 1) * mb))
        t3 = time.perf_counter()
        if r:
            floor.append(t1 - t0)
            ours.append(t2 - t1)
            index.append(t3 - t2)
    tokens = n * mb * seq
    o, f, x = statistics.median(ours), statistics.median(floor), statistics.median(index)
    return {"micro_batches": n, "tok_s": round(tokens / o), "floor_tok_s": round(tokens / f),
            "ratio_to_floor": round(f / o, 3), "us_per_micro_batch": round(o / n * 1e6, 1),
            "floor_us_per_micro_batch": round(f / n * 1e6, 1),
            "index_share": round(x / o, 3), "index_us_per_micro_batch": round(x / n * 1e6, 1),
            "headroom_vs_step": round(tokens / o / shape["needed_tok_s"], 1)}


# --- 3. remote ------------------------------------------------------------------------------

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
           "cache_blocks": storage.CACHE_BLOCKS, "cases": {}}
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


# --- report ---------------------------------------------------------------------------------

def report(res: dict) -> None:
    if "prepare" in res:
        report_prepare(res["prepare"])
    if "loader" in res:
        report_loader(res)
    if "remote" in res:
        report_remote(res["remote"])


def report_prepare(p: dict) -> None:
    print(f"\n1. prepare: {p['files']} files, {p['text_bytes'] / 1e6:.1f} MB of .py, "
          f"{p['tokens']:,} tokens ({p['text_bytes'] / p['tokens']:.2f} bytes a token), "
          f"BPE {VOCAB} trained in {p['tokenizer_train_s']:.1f} s; median of {p['rounds']} "
          f"(min-max)")
    print(f"   {'what':<34} {'seconds':>20} {'tokens/s':>10} {'per worker':>11} "
          f"{'/ ref':>6} {'1st batch':>9} {'CPU s':>6} {'of it here':>10} {'tok/CPU-s':>10} "
          f"{'/ ref1':>7}")
    for key, what in (("ref1", "reference: encode_batch, 1 thread"),
                      ("w1", "prepare, workers=1"),
                      ("ref2", "reference: encode_batch, 2 threads"),
                      ("w2", "prepare, workers=2")):
        r = p[key]
        secs = f"{r['s']:.2f} ({r['s_min']:.2f}-{r['s_max']:.2f})"
        per = f"{r['tok_s_per_worker']:,}" if "tok_s_per_worker" in r else ""
        ratio = f"{r['ratio_to_ref']:.2f}" if "ratio_to_ref" in r else ""
        first = f"{r['first_batch_s']:.2f}s" if "first_batch_s" in r else ""
        cratio = f"{r['cpu_ratio_to_ref']:.2f}" if "cpu_ratio_to_ref" in r else ""
        print(f"   {what:<34} {secs:>20} {r['tok_s']:>10,} {per:>11} {ratio:>6} {first:>9} "
              f"{r['cpu_s']:>6.2f} {r['cpu_here_s']:>10.2f} {r['tok_per_cpu_s']:>10,} "
              f"{cratio:>7}")
    print("   / ref: wall-time ratio to the reference with as many threads as workers; CPU s: "
          "this process and its children (workers, forkserver); / ref1: CPU ratio to 1 thread")


def report_loader(res: dict) -> None:
    print("\n2. loader: DatasetTokens.batch, 2 sources 3:1, shuffled, eval_fraction 0.01; "
          "floor: np.memmap slices")
    print(f"   {'shape':<30} {'tokens/s':>11} {'floor':>12} {'/ floor':>8} {'us/mb':>8} "
          f"{'floor us/mb':>11} {'index us/mb':>11} {'step needs':>11} {'headroom':>9}")
    for name, s in res["shapes"].items():
        lo = res["loader"][name]
        label = f"{name} seq {s['seq_len']} x mb {s['micro_batch']}"
        print(f"   {label:<30} {lo['tok_s']:>11,} {lo['floor_tok_s']:>12,} "
              f"{lo['ratio_to_floor']:>8.3f} {lo['us_per_micro_batch']:>8.1f} "
              f"{lo['floor_us_per_micro_batch']:>11.1f} {lo['index_us_per_micro_batch']:>11.1f} "
              f"{s['needed_tok_s']:>11,} {lo['headroom_vs_step']:>8}x")
    for name, s in res["shapes"].items():
        print(f"   {name}: {s['global_batch']} x {s['seq_len']} tokens per {s['step_s']} s step "
              f"({s['plan']})")
    print("   index: Mixture.locate alone (blend + Feistel shuffle) for the same micro-batches; "
          "headroom: tokens/s / what the step needs")


def report_remote(r: dict) -> None:
    print(f"\n3. remote: slowmem:// ({r['latency_ms']} ms a range read), blocks "
          f"{r['block_mib']:g} MiB x {r['cache_blocks']} cached per file; {r['shape']} shape "
          f"(seq {r['seq_len']} x mb {r['micro_batch']}), fake step {r['step_s']} s over "
          f"{r['micro_batches']} micro-batches")
    print(f"   {'source (.bin per source)':<31} {'read_ahead':>10} {'wait share':>11} "
          f"{'wait/step':>10} {'max':>7} {'of it CPU':>10} {'step':>7} {'step 0 wait':>12} "
          f"{'reads/sample':>13} {'fetch/step':>11}")
    for name, rows in r["cases"].items():
        label = {"local": "local files (memmap, no latency)",
                 "stdlib": f"slowmem, stdlib ({r['small_bin_mib']} MiB)",
                 "big": f"slowmem, repeated ({r.get('big_bin_mib')} MiB)"}[name]
        for row in rows:
            print(f"   {label:<31} {row['read_ahead']:>10} {row['wait_share']:>11.1%} "
                  f"{row['wait_ms_per_step']:>8.1f}ms {row['max_wait_ms']:>5.0f}ms "
                  f"{row['get_cpu_ms_per_step']:>8.1f}ms "
                  f"{row['step_ms']:>5.0f}ms {row['first_step_wait_ms']:>10.1f}ms "
                  f"{row['range_reads_per_sample']:>13.3f} {row['fetch_ms_per_step']:>9.1f}ms")
    print("   wait share: time in loader.get / wall time of the timed steps (step 0 apart); "
          "wait/step: median, max: the worst step;\n   of it CPU: the training thread's CPU "
          "time in loader.get; fetch/step: seconds of range reads per step's samples")
    print("   goal: wait share < 5% with read-ahead")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of 1 and 2 (medians)")
    ap.add_argument("--loader-tokens", type=int, default=500_000,
                    help="tokens per loader round and shape")
    ap.add_argument("--demo-seq", type=int, help="seq_len of the demo shape (default: its plan's)")
    ap.add_argument("--demo-micro", type=int,
                    help="micro_batch of the demo shape (default: its plan's)")
    ap.add_argument("--demo-step-s", type=float, default=0.4,
                    help="the real-text demo's step on these CPUs, measured when it was 16 x 128 "
                         "tokens (plans/cpu-text.yaml now has seq_len 64)")
    ap.add_argument("--gpu-step-s", type=float, default=0.716,
                    help="the 1B run's step on one H200 (docs/benchmarks.md, GPU)")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="slept per range read")
    ap.add_argument("--remote-shape", choices=("demo", "1B"), default="demo",
                    help="micro-batches of section 3")
    ap.add_argument("--step-s", type=float,
                    help="fake step of section 3 (default 0.2 s, or --gpu-step-s for 1B)")
    ap.add_argument("--steps", type=int, default=10, help="timed fake steps per case")
    ap.add_argument("--big-mib", type=int, default=128,
                    help="the larger-than-cache source of section 3 (0: skip)")
    ap.add_argument("--sections", default="prepare,loader,remote",
                    help="which of prepare,loader,remote to run (comma-separated)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = ap.parse_args()

    res = {"command": command(), "machine_start": machine()}
    if not args.json:
        print(f"command: {res['command']}")
        print(f"machine: {res['machine_start']['cores']} cores, load average "
              f"{' '.join(map(str, res['machine_start']['load']))}", flush=True)
    t0 = time.perf_counter()
    sections = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        if "prepare" in sections:
            res["prepare"] = bench_prepare(args, tmp)
        else:  # the sources the other sections read, untimed
            corpus = sysconfig.get_paths()["stdlib"] + "/*.py"
            train_tokenizer([corpus], VOCAB, f"{tmp}/tokenizer.json", text_exts=[".py"])
            prepare([corpus], f"{tmp}/tokenizer.json", f"{tmp}/tokens-w1", workers=1,
                    text_exts=[".py"])
            shutil.copytree(f"{tmp}/tokens-w1", f"{tmp}/tokens-w2")
        res["shapes"] = shapes(args)
        if "loader" in sections:
            res["loader"] = {name: bench_loader(args, tmp, s)
                             for name, s in res["shapes"].items()}
        if "remote" in sections:
            res["remote"] = bench_remote(args, tmp, res["shapes"][args.remote_shape])
    res["machine_end"] = machine()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    report(res)
    print(f"\nwall {res['wall_s']} s; load average at the end "
          f"{' '.join(map(str, res['machine_end']['load']))}")


if __name__ == "__main__":
    main()
