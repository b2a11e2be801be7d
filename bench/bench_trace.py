"""How big a timeline of one sampled step is at 12,288 ranks (train/trace.py).

The layout of MegaScale's 175B run (tp 8, pp 8, interleave 6, dp 192, micro-batch 1, global
batch 6144: 32 micro-batches per replica). Each traced rank records a forward and a backward per
micro-batch and chunk plus a wait around each transfer; the events are synthetic, the document
is the one `train` writes (`chrome_trace`), so its bytes are what rank 0 would write.

    .venv/bin/python bench/bench_trace.py
"""

from __future__ import annotations

import json
import time

from mscale.config.layout import LayoutConfig
from mscale.train import trace

LAYOUT = LayoutConfig(tp=8, pp=8, vpp=6, dp=192, micro_batch=1)
MICRO, CHUNKS, PER_NODE = 32, 6, 8


def events_of_one_rank() -> list[tuple[str, int, int, float, float]]:
    out, t = [], 0.0
    for chunk in range(CHUNKS):
        for m in range(MICRO):
            for name in ("pp wait", "forward", "pp wait", "backward"):
                out.append((name, m if "wait" not in name else -1,
                            chunk if "wait" not in name else -1, t, t + 0.01))
                t += 0.01
    out.append(("dp wait", -1, -1, t, t + 0.1))
    return out


def main() -> None:
    world = LAYOUT.tp * LAYOUT.pp * LAYOUT.dp
    events = events_of_one_rank()
    limit = trace.events_limit(MICRO, CHUNKS)
    row = trace.pack(events, limit)
    places = trace.rank_places(LAYOUT, [f"node{i}" for i in range(world // PER_NODE)],
                               lambda r: r // PER_NODE)
    replica = trace.traced_ranks(LAYOUT, "replica")
    t0 = time.perf_counter()
    doc = trace.dumps(trace.chrome_trace({r: row for r in replica}, 100, places))
    build_s = time.perf_counter() - t0
    per_rank = len(doc) / len(replica)
    print(json.dumps({
        "world": world, "events_per_rank": len(events), "row_limit": limit,
        "sent_bytes_per_traced_rank": row.numel() * row.element_size(),
        "replica": {"ranks": len(replica), "json_bytes": len(doc),
                    "rank0_received_bytes": (len(replica) - 1) * row.numel() * 8,
                    "build_s": round(build_s, 2)},
        "all_estimate": {"ranks": world, "json_bytes": int(per_rank * world),
                         "rank0_received_bytes": (world - 1) * row.numel() * 8}}, indent=1))


if __name__ == "__main__":
    main()
