"""bench_manifest.py's steps 4 to 9, the resume: rank 0's load_committed and broadcast, every
rank's decode and reader, the offline reader of every index, and the indexes a rank reads after
recover drops a DP replica or at another TP/PP split. Each ``child_*`` runs in a fresh process
(bench_manifest.py's ``child``); mscale and torch are imported there, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_manifest_commit import ckpt_dir
from bench_manifest_measure import Steps


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

