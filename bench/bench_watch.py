"""Benchmark: the per-rank metrics stream at 12,288 ranks, written by train and read by watch.

Prints figures (not a test; no pass/fail), docs/benchmarks.md "watch" keeps the last run's:

1. bytes per step rank 0 appends to metrics.jsonl, schema 1 (JSON lists) against schema 2
   (compact vectors, config/vectors.py), and rank 0's CPU time to build and serialise a record,
   from the real `train.metrics.build_record` on timings shaped like a 3D-parallel job's;
2. append cost stays O(record): the first and the last tenth of the appends, locally and on
   ``memory://`` (an object store: one segment object per record);
3. ingestion on one core (the process pinned to one CPU): `MetricsFeed.poll` + `records_to_window`
   into a bounded window of the last ``--window`` steps, records/s and resident memory sampled
   along a long stream (``settled``: after 10% of it, and at least two windows' worth; flat means
   ``end`` is no higher), for schema 2 and schema 1 on a local file and schema 2 on ``memory://``.

    .venv/bin/python bench/bench_watch.py                       # 12,288 ranks, 2,000 records
    .venv/bin/python bench/bench_watch.py --records 300         # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mscale.runs.atomic import append_line  # noqa: E402
from mscale.train.metrics import FIELDS, build_record  # noqa: E402
from mscale.watch.stream import MetricsFeed, records_to_window  # noqa: E402
from mscale.watch.window import PER_RANK  # noqa: E402


def timings(world: int, seed: int) -> torch.Tensor:
    """[world, len(FIELDS)] as the gather returns it: a synchronous job's step (every rank ends
    together, ms of jitter), compute with its noise, pipeline bubble, small data waits."""
    rng = np.random.default_rng(seed)
    step = 1.0 + rng.normal(0, 0.002, world)
    compute = 0.62 + rng.normal(0, 0.01, world)
    data = np.abs(rng.normal(0.002, 0.001, world))
    bubble = np.abs(rng.normal(0.08, 0.005, world))
    comm = step - compute - data - bubble
    tp = comm * rng.uniform(0.5, 0.7, world)  # the split of comm_wait by kind of traffic
    dp = comm - tp
    out = np.stack([step, compute, comm, data, bubble, tp, bubble, dp,
                    np.full(world, 2.5), np.ones(world)], axis=1)
    assert out.shape[1] == len(FIELDS)
    return torch.from_numpy(out)


def record(world: int, seed: int, version: int):
    rec = build_record(timings(world, seed), step=seed + 1, grad_norm=1.0, clip_threshold=2.0,
                       lr=1e-4, tokens=1 << 22, flops_per_step=1e18, peak_flops_per_device=3e14)
    return rec.model_copy(update={"schema_version": version})


def bytes_per_step(world: int, repeats: int) -> dict:
    """Bytes of one appended line and rank 0's ms to build + serialise it, per version."""
    out = {}
    for version in (1, 2):
        lines, t0 = [], time.perf_counter()
        for i in range(repeats):
            rec = build_record(timings(world, i), step=i + 1, grad_norm=1.0, clip_threshold=2.0,
                               lr=1e-4, tokens=1 << 22, flops_per_step=1e18,
                               peak_flops_per_device=3e14)
            if rec.schema_version != version:
                rec = rec.model_copy(update={"schema_version": version})
            lines.append(rec.model_dump_json(exclude_none=True))
        ms = (time.perf_counter() - t0) / repeats * 1e3
        out[f"v{version}"] = {"bytes": int(np.mean([len(x) + 1 for x in lines])),
                              "build_and_serialise_ms": round(ms, 2)}
    out["ratio"] = round(out["v1"]["bytes"] / out["v2"]["bytes"], 2)
    return out


def pool(world: int, version: int, size: int) -> list[str]:
    """Distinct record bodies (everything after ``step``), so a long stream is cheap to write."""
    out = []
    for i in range(size):
        text = record(world, i, version).model_dump_json(exclude_none=True)
        out.append(text[text.index(',"time"'):])
    return out


def write_stream(url: str, bodies: list[str], records: int, version: int,
                 append: bool = False) -> None:
    lines = (f'{{"schema_version":{version},"step":{s + 1}{bodies[s % len(bodies)]}'
             for s in range(records))
    if append:
        for text in lines:
            append_line(url, text)
        return
    with open(url, "w") as f:
        for text in lines:
            f.write(text + "\n")


def append_cost(bodies: list[str], n: int) -> dict:
    """ms per append for the first and the last tenth of ``n`` appends."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for where, url in (("local", f"{tmp}/m.jsonl"),
                           ("memory", f"memory://bench-{uuid.uuid4().hex[:8]}/m.jsonl")):
            times = []
            for s in range(n):
                t0 = time.perf_counter()
                append_line(url, f'{{"schema_version":2,"step":{s + 1}{bodies[s % len(bodies)]}')
                times.append(time.perf_counter() - t0)
            tenth = max(1, n // 10)
            out[where] = {"first_ms": round(float(np.mean(times[:tenth])) * 1e3, 3),
                          "last_ms": round(float(np.mean(times[-tenth:])) * 1e3, 3)}
            if where == "memory":
                import fsspec

                fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)
    return out


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Ring:
    """The last ``n`` steps of per-rank times: what a watcher keeps, whatever the run's length."""

    def __init__(self, n: int, world: int):
        self.ranks = np.full((n, len(PER_RANK), world), np.nan)  # pages committed now
        self.count = 0

    def add(self, ranks: np.ndarray) -> None:
        k = min(len(ranks), len(self.ranks))
        idx = (self.count + np.arange(len(ranks) - k, len(ranks))) % len(self.ranks)
        self.ranks[idx] = ranks[-k:] if k else ranks[:0]
        self.count += len(ranks)


def ingest(url: str, world: int, window: int, max_bytes: int) -> dict:
    """Poll + decode everything at ``url`` into a `Ring`; records/s and RSS along the way."""
    feed, ring = MetricsFeed(url, max_bytes=max_bytes), Ring(window, world)
    samples, seen, poll_s, decode_s = [], 0, 0.0, 0.0
    start_rss = rss_mb()
    while True:
        t0 = time.perf_counter()
        recs = feed.poll()
        t1 = time.perf_counter()
        if recs:
            ring.add(records_to_window(recs, world).ranks)
        decode_s += time.perf_counter() - t1
        poll_s += t1 - t0
        seen += len(recs)
        samples.append((seen, rss_mb()))
        if feed.caught_up:
            break
    settled = next(r for s, r in samples if s >= max(seen // 10, min(window * 2, seen)))
    return {"records": seen, "records_per_s": round(seen / (poll_s + decode_s), 1),
            "poll_ms_per_record": round(poll_s / seen * 1e3, 2),
            "decode_ms_per_record": round(decode_s / seen * 1e3, 2),
            "rss_mb_start": round(start_rss), "rss_mb_settled": round(settled),
            "rss_mb_end": round(samples[-1][1]), "rss_mb_max": round(max(r for _, r in samples))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=12288)
    ap.add_argument("--records", type=int, default=2000, help="schema-2 stream length")
    ap.add_argument("--v1-records", type=int, default=300, help="schema-1 stream (1.9 MB each)")
    ap.add_argument("--window", type=int, default=64, help="steps the watcher keeps")
    ap.add_argument("--max-bytes", type=int, default=8 << 20, help="MetricsFeed's per poll")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    res: dict = {"world": args.world, "window_steps": args.window, "max_bytes": args.max_bytes,
                 "bytes_per_step": bytes_per_step(args.world, 5)}
    bodies = {v: pool(args.world, v, 16) for v in (1, 2)}
    res["append_ms"] = append_cost(bodies[2], 500)
    with tempfile.TemporaryDirectory() as tmp:
        for name, version, n in (("v2_local", 2, args.records), ("v1_local", 1, args.v1_records)):
            path = f"{tmp}/{name}.jsonl"
            write_stream(path, bodies[version], n, version)
            res[name] = ingest(path, args.world, args.window, args.max_bytes)
            os.unlink(path)
    url = f"memory://bench-{uuid.uuid4().hex[:8]}/metrics.jsonl"
    write_stream(url, bodies[2], min(args.records, 500), 2, append=True)
    res["v2_memory_segments"] = ingest(url, args.world, args.window, args.max_bytes)
    res["peak_rss_mb_process"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(res, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
