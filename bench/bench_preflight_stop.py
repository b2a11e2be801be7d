"""Benchmark: rank 0 reading a stopped preflight back from the job's store, old way vs new.

Not a test; prints figures (no pass/fail).

When a preflight collective fails, rank 0 reads every rank's records from the torch.distributed
store (`preflight/marks.py`, `runner._when_stopped`) after the operator's ``--timeout`` has
already expired. One process plays every rank of a world of ``--world`` ranks against a real
TCPStore (libuv server in this process, a PrefixStore over it, as the job's default store):
each rank registers its node and marks start, groups, compute and p2p with its figures; rank 0
stopped in 'collectives', where every other rank saw the failure too, except ``--lost`` ranks
that never answered. Then the read-back is timed both ways, alternately, ``--repeat`` times:

- reference: the key-per-rank read-back before marks.py (copied below: ``check`` of the phase's
  and the failure's key per rank, then ``check`` + ``get`` of each record, then the node of
  each rank without figures);
- marks.py: one ``multi_get`` of the rank lists, then the records ``CHUNK`` at a time.

Round trips are counted by a wrapper that counts store calls (a separate, untimed pass). The
grace period is 0 for both (with ranks lost both wait the whole of it; that is not read-back).

    .venv/bin/python bench/bench_preflight_stop.py                 # 4,096 ranks, 3 repeats
    .venv/bin/python bench/bench_preflight_stop.py --world 12288 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

KEY = "mscale-preflight"


class Counted:
    """A store whose every call is counted: one call, one round trip to the server."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            self.calls += 1
            return method(*args)
        return call


def old_mark(store, phase: str, rank: int, payload: dict | None = None) -> None:
    """The reference's writer (runner._mark before marks.py): a key per rank and phase."""
    if payload is not None:
        store.set(f"{KEY}/payload/{rank}", json.dumps(payload))
    store.set(f"{KEY}/{phase}/{rank}", "1")
    store.add(f"{KEY}/count/{phase}", 1)


def old_read_back(store, phase: str, world: int, payload: dict) -> tuple:
    """The reference's reader: missing_ranks, _when_stopped's loop, _node_of_rank per rank
    without figures (as failure_report asks it), with a grace of 0."""
    lost = [r for r in range(1, world) if not store.check([f"{KEY}/{phase}/{r}"])
            and not store.check([f"{KEY}/failed/{r}"])]
    payloads, stops = [payload], {}
    for r in range(1, world):
        if store.check([f"{KEY}/payload/{r}"]):
            payloads.append(json.loads(store.get(f"{KEY}/payload/{r}")))
        if store.check([f"{KEY}/failed/{r}"]):
            stops[r] = json.loads(store.get(f"{KEY}/failed/{r}"))
    known = {p["rank"] for p in payloads}
    nodes = {r: store.get(f"{KEY}/node/{r}").decode() for r in range(world)
             if r not in known and store.check([f"{KEY}/node/{r}"])}
    return payloads, stops, lost, nodes


def new_read_back(world: int, payload: dict) -> tuple:
    from mscale.preflight import runner

    payloads, stops, lost, node_of = runner._when_stopped(world, payload, RuntimeError("x"))
    known = {p["rank"] for p in payloads}
    return payloads, stops, lost, {r: node_of(r) for r in range(world) if r not in known}


def _payload(rank: int, world: int) -> dict:
    """About the figures a rank of a tp8·dp-many plan leaves after p2p: ~1.5 kB of JSON."""
    group = [rank // 8 * 8 + i for i in range(8)]
    pairs = [{"kind": k, "ranks": [rank, (rank + d) % world], "gbps": 180.0 + d}
             for k, d in (("tp", 1), ("tp", 7), ("dp", 8), ("dp", world - 8))]
    return {"rank": rank, "node": f"node{rank // 8 + 1:05d}", "device": "cuda", "phase": "p2p",
            "phase_t0": 1234.5, "gemm": {"tflops": 712.3, "n": 8192, "dtype": "bfloat16"},
            "pairs": pairs, "tp_group": group}


def fill(store, world: int, lost: set[int]) -> None:
    """Both layouts of the same records: every rank up to p2p, then the failures."""
    from mscale.preflight import marks, runner

    for r in range(world):
        p = _payload(r, world)
        store.set(f"{KEY}/node/{r}", p["node"])
        marks.register(r, p["node"])
        for phase, carries in (("start", True), ("groups", False), ("compute", True),
                               ("p2p", True)):
            old_mark(store, phase, r, p if carries else None)
            marks.mark(phase, r, p if carries else None)
        if r and r not in lost:
            p["phase"] = "collectives"
            runner._mark_failed(p, r, RuntimeError("Timed out waiting 60000ms for recv"))
            store.add(f"{KEY}/count/failed", 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4096)
    ap.add_argument("--lost", type=int, default=8, help="ranks that never answered")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from torch.distributed import PrefixStore, TCPStore

    from mscale.preflight import marks, runner

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    store = PrefixStore("default_pg", server)
    marks.store = lambda: store  # the job's default store, as rank 0 sees it
    runner.STOP_GRACE_S = 0.0
    world = args.world
    lost = set(range(world - args.lost, world))
    t0 = time.perf_counter()
    fill(store, world, lost)
    print(f"world {world}, {args.lost} lost; filled in {time.perf_counter() - t0:.1f} s")
    mine = {**_payload(0, world), "phase": "collectives"}
    old, new = old_read_back(store, "collectives", world, mine), new_read_back(world, mine)
    assert old[0] == new[0] and set(old[1]) == set(new[1]) - {0} and old[2] == new[2], "differ"
    counted = Counted(store)
    old_read_back(counted, "collectives", world, mine)
    trips_old, counted.calls = counted.calls, 0
    marks.store = lambda: counted
    new_read_back(world, mine)
    trips_new, marks.store = counted.calls, (lambda: store)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(args.repeat):  # alternate, so neither side is always the colder one
        for name, read in (("old", lambda: old_read_back(store, "collectives", world, mine)),
                           ("new", lambda: new_read_back(world, mine))):
            t0 = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - t0)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"round trips: reference {trips_old:,} ({trips_old / world:.1f} a rank), "
          f"marks.py {trips_new:,}")
    print(f"read-back, median of {args.repeat}: reference {o:.3f} s "
          f"({min(times['old']):.3f}-{max(times['old']):.3f}), marks.py {n:.3f} s "
          f"({min(times['new']):.3f}-{max(times['new']):.3f}); ratio {o / n:.1f}x")


if __name__ == "__main__":
    main()
