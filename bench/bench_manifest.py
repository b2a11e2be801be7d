"""Benchmark: the checkpoint manifest of a plan at full scale, rank 0's commit and the resume.

No tensor is written. For each rank of ``--plan`` (the first ``--ranks N`` only, if given), the
report its `Checkpointer._report` would send to rank 0 is built from the rank's real write set
(`ownership.write_items(for_plan(plan, rank))` plus its CPU and CUDA generator states): a
`ShardInfo` made as `writer.write_shard` makes it (`shard_name`, one chunk table per slice cut at
the default 4 MiB, `shard_checksum`), with random crc32s (as wide in JSON as real ones) and, for
zstd, stored sizes drawn between 80% and 95% of the raw ones.

``--schema 2`` (the format mscale writes) puts each rank's slices in its index file, written to
disk by `writer.write_index` as a save does, and the report names it (`commit.reported_tensors`
for the tensor table); ``--schema 1`` (the reference: the format before) lists the slices in the
report and the manifest, every rank reporting every tensor it wrote. Then, each step a fresh
process, every step with the library's own functions:

1. gather: the reports as ``gather_json`` serialises them (bytes, count, the largest, and what
   rank 0 receives: every rank padded to the largest); rank 0's decode of them, as
   ``gather_json`` does it (``json.loads`` of each padded uint8 buffer's prefix)
2. ``commit.build_manifest`` of the decoded reports (rank 0, training thread)
3. the decoded reports freed (rank 0, training thread, as `_finish` returns), then
   ``manifest_bytes``: manifest.json's bytes (rank 0, writer thread)
4. load_committed: ``sha256`` and ``checks.parse_manifest`` of those bytes, from memory (rank 0
   at resume, and the launcher's ``check_resume``)
5. resume broadcast, rank 0: ``ResumePoint.to_json`` and its ``json.dumps`` (`agree.agree`,
   ``broadcast_json``)
6. resume, every rank: ``json.loads`` of the broadcast buffer, ``ResumePoint.from_json`` and the
   ``CheckpointReader`` of rank 0 at the same layout (schema 2: it reads the indexes that
   `locate.likely_writers` names); per rank, so ×8 per node of host memory
7. schema 2 only: a reader of every shard's index, as an offline convert or verify builds
8. schema 2 only: how many indexes a rank reads after recover dropped one DP replica
   (`locate.likely_writers` for 64 ranks of that plan; exact by tests/unit/ckpt/test_index.py)
9. schema 2 only: at another TP/PP split (half the TP, twice the PP), 4 ranks' guess and a
   reader of the indexes it names

Each step's wall seconds and peak RSS (``ru_maxrss``, its high-water mark reset through
/proc/self/clear_refs before the step), beside the RSS the process already held when the step
began (its inputs). With N < world ranks the figures are also printed scaled linearly to the
whole world (times, sizes, and RSS above the process's baseline after imports), labelled as
extrapolated. Each process's raw figures go to stderr as it ends (a long run cut short keeps
them). Not a test: no pass/fail. A full 12,288-rank run takes ~5 minutes and ~6 GB of RAM
(schema 1: ~8 minutes, ~10 GB).

    .venv/bin/python bench/bench_manifest.py --ranks 64      # seconds
    .venv/bin/python bench/bench_manifest.py --ranks 768     # half a minute, extrapolated
    .venv/bin/python bench/bench_manifest.py                 # every rank of the plan
    .venv/bin/python bench/bench_manifest.py --plan plans/X.yaml --ranks 768 --json
    .venv/bin/python bench/bench_manifest.py --ranks 768 --schema 1   # the format before
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = REPO / "plans" / "gpt-175b-h800-12288.yaml"
STEP = 1000
CUDA_RNG_BYTES = 16
"""torch.cuda.get_rng_state(): a Philox seed and offset (the CPU state is measured here)."""
ZSTD_RATIO = (0.80, 0.95)
"""Stored / raw bytes of a zstd chunk, drawn per chunk (the JSON is as long either way)."""


# --------------------------------------------------------------------------- measuring
def rss_mb() -> float:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def peak_mb() -> float:
    """The high-water mark of the resident set (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def reset_peak() -> None:
    """Start ``ru_maxrss`` again from the current RSS (Linux >= 4.0), so each step's peak is its
    own and not an earlier step's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Steps:
    """Timed steps of one child process, each with its own peak RSS."""

    def __init__(self) -> None:
        gc.collect()
        self.base = rss_mb()
        self.rows: list[dict] = []

    def run(self, name: str, fn):
        gc.collect()
        reset_peak()
        held = rss_mb()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        self.rows.append({"step": name, "wall_s": wall, "held_mb": held,
                          "peak_mb": max(held, peak_mb()),
                          "base_mb": self.base})
        return out


# --------------------------------------------------------------------------- step 0: reports
def rank_items(plan, rank: int, meta: dict) -> list:
    """What ``rank`` writes: its write set and its generator states (`Checkpointer.items`;
    a GPU rank has two, `snapshot.rng_states`)."""
    import torch

    from mscale.ckpt.manifest import RNG, tensor_key
    from mscale.ckpt.ownership import Item, for_plan, write_items

    items = write_items(for_plan(plan, rank, meta))
    states = {"cpu": torch.get_rng_state().numel()}
    if not plan.cluster.gpu.is_cpu:
        states["cuda"] = CUDA_RNG_BYTES
    for kind, n in states.items():
        items.append(Item(tensor_key(f"{RNG}.{kind}", f"rank-{rank:05d}"), (n,), "uint8",
                          ((0, n),), (0, n), ("rng", kind)))
    return items


def shard_report(rank: int, items: list, codec: str, chunk_bytes: int,
                 rnd: random.Random, schema: int, ckpt: str) -> dict:
    """`Checkpointer._report` of a successful write of ``items``: the `ShardInfo` as
    `writer.write_shard` returns it, chunk tables synthesised (schema 2: its index file written
    into ``ckpt``)."""
    from mscale.ckpt.checks import raw_lengths
    from mscale.ckpt.commit import reported_tensors
    from mscale.ckpt.format import shard_checksum
    from mscale.ckpt.manifest import ShardInfo, SliceInfo, itemsize, shard_name
    from mscale.ckpt.writer import write_index

    slices, crcs, offset, raw_bytes = [], [], 0, 0
    for it in items:
        nbytes = it.count * itemsize(it.dtype)
        raw_bytes += nbytes
        table = [[n if codec == "raw" else max(1, int(n * rnd.uniform(*ZSTD_RATIO))),
                  rnd.getrandbits(32)] for n in raw_lengths(nbytes, chunk_bytes)]
        slices.append(SliceInfo(tensor=it.key, box=[list(b) for b in it.box],
                                flat=list(it.flat), offset=offset, chunks=table))
        crcs += [c[1] for c in table]
        offset += sum(c[0] for c in table)
    name = shard_name(rank)
    if schema == 1:
        info = ShardInfo(path=name, rank=rank, bytes=offset, checksum=shard_checksum(crcs),
                         slices=slices)
        tensors = {it.key: [list(it.shape), it.dtype] for it in items}
    else:
        info = ShardInfo(path=name, rank=rank, bytes=offset, checksum=shard_checksum(crcs),
                         index=write_index(ckpt, rank, name, slices))
        tensors = reported_tensors(items)
    return {"rank": rank, "blocking_s": rnd.random(), "gate_waited_s": rnd.random() / 100,
            "waited_s": rnd.random() / 100, "shard": info.model_dump(),
            "write_s": rnd.uniform(1, 10), "copy_s": rnd.random(), "raw_bytes": raw_bytes,
            "tensors": tensors, "slices": len(slices)}


def child_reports(a) -> dict:
    """Every rank's report as `gather_json` serialises it, one line each in ``reports.jsonl``."""
    from mscale.topology.placement import load_checked_plan

    plan = load_checked_plan(a.plan)
    world = plan.layout.world_size
    rnd, meta, sizes, slices, written = random.Random(0), {}, [], 0, {}
    t0 = time.perf_counter()
    with open(Path(a.tmp) / "reports.jsonl", "wb") as out:
        for rank in range(min(a.ranks or world, world)):
            items = rank_items(plan, rank, meta)
            report = shard_report(rank, items, a.codec, a.chunk_bytes, rnd, a.schema,
                                  ckpt_dir(a))
            slices += report.pop("slices")
            data = json.dumps(report).encode()  # what gather_json sends
            sizes.append(len(data))
            out.write(data + b"\n")
            written.update((it.key, [list(it.shape), it.dtype]) for it in items)
    # with --ranks N < world, a tensor these ranks wrote may be named by a rank left out: kept
    # aside (child_commit), and added to the manifest only before its index files are read
    (Path(a.tmp) / "written.json").write_text(json.dumps(written))
    return {"world": world, "ranks": len(sizes), "slices": slices, "bytes": sum(sizes),
            "largest": max(sizes), "padded": len(sizes) * max(sizes),
            "seconds": time.perf_counter() - t0}


def ckpt_dir(a) -> str:
    """Where schema 2's index files go (and the manifest the readers open)."""
    return str(Path(a.tmp) / "step-001000")


# --------------------------------------------------------------------------- steps 1-3: commit
def child_commit(a) -> list[dict]:
    import torch

    from mscale.ckpt import commit
    from mscale.ckpt.manifest import TrainState, manifest_bytes
    from mscale.ckpt.ownership import layout_record
    from mscale.topology.placement import load_checked_plan

    plan = load_checked_plan(a.plan)
    steps = Steps()
    lines = (Path(a.tmp) / "reports.jsonl").read_bytes().splitlines()
    sizes = [len(s) for s in lines]
    longest = max(sizes)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in lines]  # dist.gather's buffers
    for t, s in zip(out, lines):
        t[: len(s)] = torch.frombuffer(bytearray(s), dtype=torch.uint8)
    del lines
    reports = steps.run("gather: json.loads (rank 0)", lambda: [
        json.loads(bytes(t[: int(n)].numpy())) for t, n in zip(out, sizes)])
    del out  # freed when gather_json returns
    state = TrainState(step=STEP, samples=STEP * plan.training.global_batch, counts_skips=True,
                       optimizer=plan.training.optimizer, optimizer_step=STEP, lr=1e-4,
                       clip={"version": 1, "ema": 0.5, "count": STEP},
                       data_fingerprint=123456789, rng_world=plan.layout.world_size)
    manifest = steps.run("build_manifest (rank 0)", lambda: commit.build_manifest(
        STEP, reports, codec=a.codec, level=a.level, chunk_bytes=a.chunk_bytes,
        layout=layout_record(plan), plan=plan.model_dump(mode="json", exclude_none=True),
        state=state, schema_version=a.schema))
    named = {k for r in reports for k in r["tensors"]}
    written = json.loads((Path(a.tmp) / "written.json").read_text())
    (Path(a.tmp) / "written.json").write_text(json.dumps(
        {k: v for k, v in written.items() if k not in named}))  # {} when every rank ran
    box = [reports]
    del reports, named, written
    steps.run("free the decoded reports (rank 0, _finish returns)", box.clear)
    raw = steps.run("manifest_bytes (rank 0)", lambda: manifest_bytes(manifest))
    steps.rows[-1]["bytes"] = len(raw)
    (Path(a.tmp) / "manifest.json").write_bytes(raw)
    return steps.rows


# --------------------------------------------------------------------------- steps 4-6: resume
def child_load(a) -> list[dict]:
    """Rank 0's side of a resume: load_committed, then the ResumePoint it broadcasts."""
    from mscale.ckpt.checks import parse_manifest
    from mscale.ckpt.manifest import sha256
    from mscale.ckpt.resume import ResumePoint

    steps = Steps()
    raw = (Path(a.tmp) / "manifest.json").read_bytes()

    def load_committed():
        sha256(raw)
        return parse_manifest(raw, "manifest.json")

    manifest = steps.run("load_committed: sha256 + parse_manifest (rank 0)", load_committed)
    del raw
    data = steps.run("resume: to_json + json.dumps (rank 0)", lambda: json.dumps(
        ResumePoint("ckpt/step-001000", manifest, []).to_json()).encode())
    steps.rows[-1]["bytes"] = len(data)
    (Path(a.tmp) / "broadcast.json").write_bytes(data)
    return steps.rows


def child_rank(a) -> list[dict]:
    """Every rank's side: decode the broadcast (`broadcast_json`), `agree.agree`'s ``from_json``,
    and `resume`'s reader."""
    import torch

    from mscale.ckpt.load import CheckpointReader, has_optimizer
    from mscale.ckpt.locate import likely_writers
    from mscale.ckpt.manifest import TensorInfo
    from mscale.ckpt.ownership import for_plan
    from mscale.ckpt.resume import ResumePoint
    from mscale.topology.placement import load_checked_plan

    steps = Steps()
    buf = torch.frombuffer(bytearray((Path(a.tmp) / "broadcast.json").read_bytes()),
                           dtype=torch.uint8)  # what dist.broadcast filled
    plan = load_checked_plan(a.plan)
    rl = for_plan(plan, 0)

    unnamed = {k: TensorInfo(shape=v[0], dtype=v[1]) for k, v in
               json.loads((Path(a.tmp) / "written.json").read_text()).items()}

    def resume():
        point = ResumePoint.from_json(json.loads(bytes(buf.numpy())))
        point.manifest.tensors.update(unnamed)  # a --ranks run's missing names (child_commit)
        prefer = likely_writers(plan, plan, rl, has_optimizer(point.manifest))
        return point, CheckpointReader(ckpt_dir(a), point.manifest, prefer=prefer)

    kept = steps.run("resume: json.loads + from_json + reader (every rank)", resume)
    assert kept[1].slices
    steps.rows[-1]["indexes"] = kept[1].indexes_read
    if a.schema == 2:
        manifest = kept[0].manifest
        del kept
        every = steps.run("offline reader of every index (convert, verify)",
                          lambda: CheckpointReader(ckpt_dir(a), manifest))
        steps.rows[-1]["indexes"] = every.indexes_read
    if a.schema == 2 and plan.layout.dp > 1:
        shrunk = without_one_replica(plan)
        sample = range(0, shrunk.layout.world_size, max(1, shrunk.layout.world_size // 64))
        meta: dict = {}
        counts = steps.run(
            f"guess after recover drops a DP replica (dp {plan.layout.dp} -> "
            f"{shrunk.layout.dp}), {len(sample)} ranks",
            lambda: [len(likely_writers(plan, shrunk, for_plan(shrunk, r, meta), True))
                     for r in sample])
        steps.rows[-1].update(indexes=max(counts), indexes_min=min(counts))
    other = another_split(plan)
    if a.schema == 2 and other is not None:
        lo = other.layout
        sample = range(0, lo.world_size, max(1, lo.world_size // 4))
        counts = steps.run(
            f"guess + reader at another split (tp {lo.tp} pp {lo.pp} vpp {lo.vpp}), "
            f"{len(sample)} ranks", lambda: [resplit_read(a, plan, other, manifest, r)
                                             for r in sample])
        steps.rows[-1].update(indexes=max(counts), indexes_min=min(counts))
    return steps.rows


def resplit_read(a, plan, other, manifest, rank: int) -> int:
    """Rank ``rank`` of ``other`` resuming from ``plan``'s checkpoint: its guess, and a reader
    of the indexes it names (those written: with --ranks N only the first N are)."""
    from mscale.ckpt.load import CheckpointReader
    from mscale.ckpt.locate import likely_writers
    from mscale.ckpt.ownership import for_plan

    prefer = likely_writers(plan, other, for_plan(other, rank), True)
    written = {s.rank for s in manifest.shards}
    with CheckpointReader(ckpt_dir(a), manifest, prefer=prefer & written) as reader:
        return reader.indexes_read


def another_split(plan):
    """``plan`` at half the TP and twice the PP (what recover's planner search may pick on the
    same world), the interleaving cut until it divides the layers; None if neither can
    change."""
    lo, layers = plan.layout, plan.model.layers
    pp = lo.pp * 2 if layers % (lo.pp * 2) == 0 else lo.pp
    tp = lo.tp // 2 if lo.tp % 2 == 0 and pp != lo.pp else lo.tp
    if (tp, pp) == (lo.tp, lo.pp):
        return None
    vpp = next(v for v in range(lo.vpp, 0, -1) if layers % (pp * v) == 0)
    return plan.model_copy(update={"layout": lo.model_copy(update={"tp": tp, "pp": pp,
                                                                   "vpp": vpp})})


def without_one_replica(plan):
    """``plan`` with one DP replica fewer (recover's first re-plan: tp/pp kept, DP shrunk), on
    as many fewer nodes (no validation: only the layout and the placement are used)."""
    layout = plan.layout.model_copy(update={"dp": plan.layout.dp - 1})
    world = layout.tp * layout.pp * layout.dp
    cluster = plan.cluster.model_copy(
        update={"nodes": max(1, world // plan.cluster.gpus_per_node)})
    return plan.model_copy(update={"layout": layout, "cluster": cluster})


CHILDREN = {"reports": child_reports, "commit": child_commit, "load": child_load,
            "rank": child_rank}


def child(a, name: str):
    """``name`` in a fresh interpreter; its result (JSON) from its stdout's last line."""
    cmd = [sys.executable, __file__, "--child", name, "--tmp", a.tmp, "--plan", a.plan,
           "--level", str(a.level), "--chunk-bytes", str(a.chunk_bytes),
           "--schema", str(a.schema)]
    if a.ranks:
        cmd += ["--ranks", str(a.ranks)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    print(f"bench_manifest: {name}: {p.stdout.splitlines()[-1]}", file=sys.stderr, flush=True)
    return json.loads(p.stdout.splitlines()[-1])


# --------------------------------------------------------------------------- report
def scaled(row: dict, k: float) -> dict:
    """A row scaled ``k`` times: time, bytes, and RSS above the process's baseline (the guess
    row is per sampled rank already: kept as measured)."""
    if "indexes_min" in row:
        return dict(row)
    out = dict(row, wall_s=row["wall_s"] * k)
    for key in ("held_mb", "peak_mb"):
        out[key] = row["base_mb"] + (row[key] - row["base_mb"]) * k
    if "bytes" in row:
        out["bytes"] = row["bytes"] * k
    return out


def table(rep: dict, rows: list[dict], k: float, title: str) -> None:
    print(f"\n{title}")
    print(f"  reports: {rep['ranks'] * k:,.0f} ranks, {rep['slices'] * k:,.0f} slices, "
          f"{rep['bytes'] * k / 1e6:,.1f} MB gathered, largest {rep['largest'] / 1e3:,.1f} KB, "
          f"padded to it {rep['padded'] * k / 1e6:,.1f} MB (ranks × largest)")
    print(f"  {'step':<56} {'wall s':>8} {'held MB':>9} {'peak MB':>9} {'+MB':>8} {'size MB':>9}")
    for r in rows:
        size = f"{r['bytes'] / 1e6:9.1f}" if "bytes" in r else ""
        if "indexes_min" in r:
            size += f"  ({r['indexes_min']:,} to {r['indexes']:,} indexes a rank)"
        elif "indexes" in r:
            size += f"  ({r['indexes']:,} indexes read)"
        print(f"  {r['step']:<56} {r['wall_s']:8.2f} {r['held_mb']:9.0f} {r['peak_mb']:9.0f} "
              f"{r['peak_mb'] - r['held_mb']:8.0f} {size}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", default=str(DEFAULT_PLAN), help="default: %(default)s")
    ap.add_argument("--ranks", type=int, default=None, metavar="N",
                    help="build the reports of the first N ranks only (default: all), and "
                         "also print the figures extrapolated to the whole world")
    ap.add_argument("--level", type=int, default=None,
                    help="zstd level of the chunks (default: CkptOptions', 0 = raw)")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="raw bytes per chunk (default: CkptOptions')")
    ap.add_argument("--schema", type=int, choices=(1, 2), default=2,
                    help="manifest schema: 2, slices in per-shard index files (what mscale "
                         "writes); 1, slices in the manifest (the reference: before)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    from mscale.ckpt.options import CkptOptions

    defaults = CkptOptions()
    a.level = defaults.level if a.level is None else a.level
    a.chunk_bytes = a.chunk_bytes or defaults.chunk_bytes
    a.codec = CkptOptions(level=a.level).codec
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-manifest-") as tmp:
        a.tmp = tmp
        rep = child(a, "reports")
        rows = child(a, "commit") + child(a, "load") + child(a, "rank")
    world, n = rep["world"], rep["ranks"]
    print(f"{Path(a.plan).name}: schema {a.schema}, {n:,} of {world:,} ranks, codec {a.codec}, "
          f"{a.chunk_bytes:,}-byte chunks (reports built in {rep['seconds']:.1f} s; whole run "
          f"{time.perf_counter() - t0:.0f} s)")
    table(rep, rows, 1.0, f"measured, {n:,} ranks (held: RSS when the step began; +MB: the "
                          f"step's own peak above it):")
    k = world / n
    if n < world:
        table(rep, [scaled(r, k) for r in rows], k,
              f"EXTRAPOLATED linearly ×{k:g} to {world:,} ranks (largest report: of the "
              f"{n:,} measured):")
    if a.json:
        print(json.dumps({"plan": a.plan, "schema": a.schema, "codec": a.codec,
                          "chunk_bytes": a.chunk_bytes,
                          "reports": rep, "measured": rows,
                          "extrapolated": [scaled(r, k) for r in rows] if n < world else None},
                         indent=1))


if __name__ == "__main__":
    main()
