"""bench_manifest.py's steps 0 to 3, the save: every rank's shard report as `Checkpointer._report`
would send it (schema 2: its index file written), then rank 0's decode of the gathered reports,
``build_manifest`` and ``manifest_bytes``. Each ``child_*`` runs in a fresh process
(bench_manifest.py's ``child``); mscale and torch are imported there, not here.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from bench_manifest_measure import Steps

STEP = 1000
CUDA_RNG_BYTES = 16
"""torch.cuda.get_rng_state(): a Philox seed and offset (the CPU state is measured here)."""
ZSTD_RATIO = (0.80, 0.95)
"""Stored / raw bytes of a zstd chunk, drawn per chunk (the JSON is as long either way)."""


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
