"""A timeline of sampled steps: every rank's forwards, backwards and waits, as a Chrome trace.

MegaScale's performance tool shows a 3D-parallel job as a timeline, one track per rank, which is
how a slow stage, a late rank or a pipeline bubble is seen at a glance. `train` records one every
``--trace-every`` steps, and at the next step after an operator drops ``control/trace``: each
rank's `StepTimer` notes its micro-batch forwards and backwards and its waits (data, pipeline
receives, DP reduction) on the clock it already times the step with (monotonic on CPUs, CUDA
events on GPUs); the traced ranks (by default DP replica 0's pipeline, ``--trace-ranks all`` for
every rank) send theirs to rank 0 as one fixed-size float64 tensor each (no pickle), and rank 0
writes ``RUN_DIR/trace/step-NNNNNN.json`` in the Chrome trace-event format, which
``ui.perfetto.dev`` and ``chrome://tracing`` open offline: one process per node, one thread
(track) per rank named by its stage and TP/DP position.

Times are seconds from each rank's own step start; ranks start a step within a collective's
latency of each other (the previous step ended in the metrics gather), so the tracks line up
without synchronised clocks across nodes.
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist

NAMES = ("forward", "backward", "data", "bubble", "comm_wait", "pp wait", "dp wait", "tp wait")
"""Event names a trace may hold, by code (`StepTimer` work spans and regions)."""
MAX_EVENTS = 4096
"""Events a rank sends per traced step at most: 2 per micro-batch and chunk, plus waits."""
COLUMNS = 5  # name code, micro-batch, chunk, start s, end s


def pack(events: list[tuple[str, int, int, float, float]], limit: int) -> torch.Tensor:
    """``[limit, 5]`` float64, NaN-padded; events past ``limit`` are dropped (the last ones)."""
    out = torch.full((limit, COLUMNS), math.nan, dtype=torch.float64)
    kept = [(NAMES.index(name), *rest) for name, *rest in events[:limit]]
    if kept:
        out[:len(kept)] = torch.tensor(kept, dtype=torch.float64)
    return out


def events_limit(micro_batches: int, chunks: int) -> int:
    """Room for every event of one rank's step: forward + backward per micro-batch and chunk,
    the posting of its transfers and a wait or two around each, the data reads and the step's
    reduction; capped."""
    return min(MAX_EVENTS, 10 * micro_batches * chunks + 16)


def traced_ranks(layout, which: str) -> list[int]:
    """The ranks whose events a traced step keeps: ``replica``, the pipeline of DP replica 0
    (pp·tp ranks: every stage and TP position once, the other replicas run the same schedule);
    ``all``, every rank (at 12,288 ranks a step's trace is then gigabytes: docs/train.md)."""
    world = layout.tp * layout.pp * layout.dp
    if which == "all":
        return list(range(world))
    return [r for r in range(world) if (r // layout.tp) % layout.dp == 0]


def collect(events, limit: int, ranks: list[int]) -> dict[int, torch.Tensor] | None:
    """Rank 0 gets ``{rank: [limit, 5]}`` of ``ranks`` (its own included), the others None:
    point-to-point from the traced ranks only, so the untraced thousands send nothing. Every
    wait is bounded by the process group's timeout (`--timeout`)."""
    row = pack(events or [], limit)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {0: row}
    rank = dist.get_rank()
    if rank != 0:
        if rank in ranks:
            dist.send(row, dst=0)
        return None
    out = {r: torch.empty_like(row) for r in ranks if r != 0}
    works = [dist.irecv(buf, src=r) for r, buf in out.items()]
    for w in works:
        w.wait()
    if 0 in ranks:
        out[0] = row
    return dict(sorted(out.items()))


def chrome_trace(rows: dict[int, torch.Tensor], step: int, ranks: list[dict]) -> dict:
    """The trace-event document of one step. ``rows``: `collect`'s ``{rank: [limit, 5]}``;
    ``ranks``: per global rank its ``node`` (name), ``node_index``, ``stage``, ``tp``, ``dp``."""
    events: list[dict] = []
    for node_index in sorted({ranks[r]["node_index"] for r in rows}):
        node = next(ranks[r]["node"] for r in rows if ranks[r]["node_index"] == node_index)
        events.append({"ph": "M", "name": "process_name", "pid": node_index, "tid": 0,
                       "args": {"name": f"node {node}"}})
    for rank in rows:
        where = ranks[rank]
        pid = where["node_index"]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                       "args": {"name": f"rank {rank} · stage {where['stage']} · "
                                        f"tp {where['tp']} · dp {where['dp']}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank,
                       "args": {"sort_index": rank}})
        for code, micro, chunk, t0, t1 in rows[rank].tolist():
            if math.isnan(code):
                break
            name = NAMES[int(code)]
            label = name if micro < 0 else f"{name} mb{int(micro)}" + (
                f" c{int(chunk)}" if chunk > 0 else "")
            events.append({"ph": "X", "name": label, "cat": name, "pid": pid, "tid": rank,
                           "ts": round(t0 * 1e6, 3), "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                           "args": {"step": step, "micro_batch": int(micro),
                                    "chunk": int(chunk)}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": step, "ranks": sorted(rows), "world": len(ranks),
                          "made_by": "mscale train"}}


def rank_places(layout, node_names: list[str], node_of) -> list[dict]:
    """Each global rank's node (``node_of(rank)``: its node index, topology/placement.py),
    stage and TP/DP position (mscale's order: tp fastest, then dp, then pp)."""
    tp, dp = layout.tp, layout.dp
    out = []
    for r in range(layout.tp * layout.pp * layout.dp):
        node_index = node_of(r)
        name = node_names[node_index] if node_index < len(node_names) else f"node{node_index}"
        out.append({"node": name, "node_index": node_index, "stage": r // (tp * dp),
                    "tp": r % tp, "dp": (r // tp) % dp})
    return out


def dumps(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"))
