"""recover/diagnose/flight.py: the wait-for graph of the ranks' flight-recorder dumps names the
rank the others waited for, and not a rank that was only stuck behind it."""

from __future__ import annotations

from mscale.distributed.flight import GROUPS_KEY
from mscale.recover.diagnose.flight import culprits, parse

S = 1_000_000_000  # ns


def entry(group: str, seq: int, t: float, pg_id: int = 1, timeout_ms: int = 5000,
          p2p: bool = False) -> dict:
    return {"pg_id": pg_id, "process_group": [group, "undefined"], "collective_seq_id": seq,
            "p2p_seq_id": 0, "is_p2p": p2p, "profiling_name": "gloo:all_reduce",
            "time_created_ns": int(t * S), "timeout_ms": timeout_ms}


def dump(groups: dict[str, list[int]], *entries: dict, status: dict | None = None) -> dict:
    return {"version": "2.10", "entries": list(entries), "pg_status": status or {},
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}, GROUPS_KEY: groups}


TP = {"tp01": [0, 1], "tp23": [2, 3]}
DP = {"dp02": [0, 2], "dp13": [1, 3]}


def test_a_rank_without_a_dump_that_its_group_waited_in_is_named():
    """tp2·dp2, rank 1 stopped before TP all-reduce 10: rank 0 waits in TP for it; rank 3 in DP
    for it; rank 2 in DP for rank 0, which is behind in DP because it is stuck in TP."""
    dumps = {
        0: dump({"tp01": [0, 1], "dp02": [0, 2]}, entry("dp02", 4, 1.0), entry("tp01", 10, 2.0)),
        2: dump({"tp23": [2, 3], "dp02": [0, 2]}, entry("tp23", 10, 2.0), entry("dp02", 5, 2.1)),
        3: dump({"tp23": [2, 3], "dp13": [1, 3]}, entry("tp23", 10, 2.0), entry("dp13", 5, 2.1)),
    }
    assert culprits(dumps) == [1]


def test_a_rank_that_enqueued_after_its_peers_timeout_is_named():
    """Continued by SIGCONT, rank 2 joined all-reduce 7 nine seconds after its peers, whose
    timeout was 5 s: it is the one they waited for, though every count is equal."""
    world = {"w": [0, 1, 2]}
    dumps = {0: dump(world, entry("w", 7, 10.0)), 1: dump(world, entry("w", 7, 10.2)),
             2: dump(world, entry("w", 7, 19.0))}
    assert culprits(dumps) == [2]


def test_ranks_a_second_apart_within_the_timeout_are_not_late():
    world = {"w": [0, 1, 2]}
    dumps = {0: dump(world, entry("w", 7, 10.0)), 1: dump(world, entry("w", 7, 11.0)),
             2: dump(world, entry("w", 7, 14.9))}
    assert culprits(dumps) == []


def test_pg_ids_are_per_process_so_groups_are_matched_by_name():
    """torch numbers pg_id in the order a process made its groups: pg 1 is rank 0's TP group and
    rank 2's another. Counted by id, rank 2 (50 < 100) read as behind rank 0."""
    def rank(group, n):
        return dump(TP, entry(group, n, 1.0, pg_id=1),
                    status={"1": {"last_enqueued_collective": str(n)}})
    dumps = {0: rank("tp01", 100), 1: rank("tp01", 100), 2: rank("tp23", 50),
             3: rank("tp23", 50)}
    assert parse(dumps[2]).seqs == {"tp23": 50}
    assert culprits(dumps) == []


def test_a_rank_whose_last_transfer_is_point_to_point_is_not_named():
    """Whom a rank waiting in a send or receive waited for is not in the dump: it may be stuck
    behind someone else, so it is never the answer on its own."""
    dumps = {0: dump(DP, entry("dp02", 6, 1.0)),
             2: dump(DP, entry("dp02", 5, 1.0), entry("pp", 3, 1.1, p2p=True))}
    assert culprits(dumps) == []


def test_pg_status_alone_still_tells_the_rank_behind():
    """torch's own JSON dump without entries: the default group's counts (pg 0 is the default
    group in every process)."""
    def nccl(n):
        return {"pg_config": {"0": {"name": "0", "ranks": "[0, 1, 2]"}},
                "pg_status": {"0": {"last_enqueued_collective": n}}, "entries": []}
    assert culprits({0: nccl(8), 1: nccl("7"), 2: nccl(8)}) == [1]


def test_damaged_dumps_name_nobody_and_raise_nothing():
    junk = [{"entries": "x"}, {"entries": [1, None, {"process_group": 3}]},
            {"pg_status": [], GROUPS_KEY: {"g": "not ranks"}},
            {"entries": [entry("g", 1, 1.0) | {"collective_seq_id": True}]}]
    assert culprits(dict(enumerate(junk))) == []


def test_a_stage_that_timed_out_in_an_unrecorded_transfer_is_not_named():
    """tp2·pp2 under srun, rank 1 stopped (behind in its TP group) then continued: it failed on
    a lost peer. Rank 3, the next stage, timed out receiving rank 1's activations, which gloo
    does not record: its last record is a world all-reduce every rank completed, and rank 2
    waits for it in TP. It timed out, so it was waiting: only rank 1 is named."""
    groups = {"w": [0, 1, 2, 3], **TP, "pp02": [0, 2], "pp13": [1, 3]}
    dumps = {0: dump(groups, entry("w", 5, 1.0), entry("tp01", 10, 2.0)),
             1: dump(groups, entry("w", 5, 1.0), entry("tp01", 9, 1.9)),
             2: dump(groups, entry("w", 5, 1.0), entry("tp23", 20, 2.0)),
             3: dump(groups, entry("tp23", 19, 0.9), entry("w", 5, 1.0))}
    assert culprits(dumps, timed_out={0, 2, 3}) == [1]
    assert culprits(dumps) == [1, 3]  # what the error files add


def test_a_late_or_missing_rank_is_named_though_it_timed_out_itself():
    world = {"w": [0, 1, 2, 3]}
    dumps = {0: dump(world, entry("w", 7, 10.0)), 1: dump(world, entry("w", 7, 10.2)),
             2: dump(world, entry("w", 7, 19.0))}
    assert culprits(dumps, timed_out={0, 1, 2}) == [2, 3]


def test_real_dumps_of_a_stopped_rank_under_srun():
    """The dumps of a real SIGSTOP hang under the local SLURM (the fixture's ``about``): every
    rank failed (timeouts, lost peers), so the error files name nobody; the dumps name rank 1.
    Rank 5, the stage after it, timed out in a receive gloo does not record."""
    import json
    from pathlib import Path

    real = json.loads((Path(__file__).parent / "data" / "flight_srun_sigstop.json").read_text())
    dumps = {int(r): d for r, d in real["dumps"].items()}
    assert sorted(dumps) == list(range(8)) and 5 in real["timed_out"]
    assert culprits(dumps, timed_out=set(real["timed_out"])) == [1]


def _pipeline_dumps(last: dict[int, list[tuple]]) -> dict[int, dict]:
    groups = {0: ["tp01", "dp02"], 1: ["tp01", "dp13"], 2: ["tp23", "dp02"],
              3: ["tp23", "dp13"], 4: ["tp45", "dp46"]}
    members = {"tp01": [0, 1], "tp23": [2, 3], "tp45": [4, 5], "dp02": [0, 2], "dp13": [1, 3],
               "dp46": [4, 6]}
    return {r: dump({g: members[g] for g in groups[r]}, *(entry(*e) for e in last[r]))
            for r in last}


STAGE_0_WAITS = {0: [("dp02", 28, 1.0), ("tp01", 392, 1.1)],
                 1: [("dp13", 28, 1.0), ("tp01", 392, 1.1)],
                 2: [("tp23", 464, 1.0), ("dp02", 31, 1.2)],
                 3: [("tp23", 464, 1.0), ("dp13", 31, 1.2)],
                 4: [("dp46", 36, 1.0), ("tp45", 433, 1.1)]}
"""tp2·pp2·dp2, rank 5 (stage 1) gone, ranks 6 and 7 left out: rank 4 waits in TP for it;
ranks 0 and 1 (stage 0) wait in a pipeline receive from stage 1, which gloo does not record
(their last entry is a TP collective both completed), and are behind in DP, so ranks 2 and 3
wait for them (review, helper-89: `--inject-hang 5:5` on cpu-tiny named 0, 1 and 5)."""


def test_a_stage_behind_only_for_an_unrecorded_transfer_is_not_named_beside_a_missing_rank():
    for timed_out in ({0, 1, 2, 3, 4}, set()):  # a timeout, or a lost peer (a crashed rank 5)
        assert culprits(_pipeline_dumps(STAGE_0_WAITS), timed_out=timed_out) == [5]
