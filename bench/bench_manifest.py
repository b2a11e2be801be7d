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
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the steps' sibling modules
# the steps each child process runs: the save (steps 0-3) and the resume (4-9), one module each
from bench_manifest_commit import child_commit, child_reports  # noqa: E402
from bench_manifest_resume import child_load, child_rank  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = REPO / "plans" / "gpt-175b-h800-12288.yaml"


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
