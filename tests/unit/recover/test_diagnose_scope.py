"""diagnose(): the hung rank is named (not its peers), only the last attempt counts, and damaged,
huge or pickled files are evidence, never a crash or code run."""

from __future__ import annotations

import json
import pickle

from mscale.recover.diagnose import read
from mscale.recover.diagnose import diagnose
from mscale.recover.diagnose.evidence import collect
from tests.unit.recover.diag_runs import GLOO_RESET, GLOO_TIMEOUT, run  # noqa: F401 - a fixture


def test_the_launchers_hang_event_names_the_stopped_rank(run):
    rid = run.start(0.0)
    run.metrics(range(1, 4), t=1)
    for rank in (0, 2, 3):
        run.error_file(rank, 9 + rank / 100, "timeout", GLOO_TIMEOUT)
    run.launcher_stop(10, rid, 0, "exited with code 3", "timeout", [3, -9, 3, 3],
                      timed_out=[0, 2, 3], stopped=[1], hang=[1])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("unknown", "hang", 3)
    assert d.suspect_ranks == [1] and d.suspect_nodes == ["node1"]
    assert d.failed_step == 3


def test_under_srun_the_rank_without_a_timeout_is_hung_not_rank_0(run):
    """rank 0's own hang event names itself (it timed out); the suspect is the silent rank."""
    run.start(0.0, run_id="slurm-4.0", launcher="slurm")
    for rank in (0, 1, 3):
        run.error_file(rank, 9 + rank / 100, "timeout", GLOO_TIMEOUT, node=f"gpu{rank // 2}")
    run.event("hang", 10, severity="critical", ranks=[0], nodes=["gpu0"],
              message="error (rank 0 on gpu0, timeout): ...",
              evidence={"kind": "timeout", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert d.symptom == "hang" and d.suspect_ranks == [2]
    assert 0 not in d.suspect_ranks
    assert any("did not time out" in e.text for e in d.evidence)


def test_of_several_silent_ranks_the_one_whose_log_went_quiet_first(run):
    run.start(0.0)
    run.error_file(0, 30, "timeout", GLOO_TIMEOUT)
    run.error_file(1, 30, "timeout", GLOO_TIMEOUT)
    run.log(0, "step 1\nstep 2\nerror (rank 0, timeout)\n", t=30)
    run.log(1, "error (rank 1, timeout)\n", t=30)
    run.log(2, "step 2 done on rank 2\n", t=12)  # quiet since step 2
    run.log(3, "killed by srun\n", t=31)
    run.event("hang", 31, source="watch", severity="critical", message="no new metrics")
    d = diagnose(run.path)
    assert d.symptom == "hang" and d.suspect_ranks == [2] and d.suspect_nodes == ["node2"]


def test_flight_recorder_json_names_the_rank_behind(run):
    run.start(0.0)
    for rank in range(4):
        enqueued = "7" if rank == 3 else 8  # the JSON dump may write numbers as text
        dump = {"version": "2.5", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                        "ranks": "[0, 1, 2, 3]"}},
                "pg_status": {"0": {"last_enqueued_collective": enqueued,
                                    "last_started_collective": enqueued,
                                    "last_completed_collective": 7}}, "entries": []}
        run.file(f"logs/nccl_trace_rank_{rank}", json.dumps(dump), t=20)
    for rank in range(4):  # every rank timed out in the watchdog: only the recorder can tell
        run.error_file(rank, 20, "timeout", "RuntimeError: [Rank 0] Watchdog caught collective "
                       "operation timeout: WorkNCCL(SeqNum=8, OpType=ALLREDUCE) ran for 600000 "
                       "milliseconds before timing out.")
    run.event("hang", 21, severity="critical", ranks=[0],
              evidence={"kind": "timeout", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert d.symptom == "hang" and d.suspect_ranks == [3]
    assert any("flight recorder" in e.text for e in d.evidence)


def test_a_flight_dump_of_an_earlier_attempt_is_not_read_for_this_one(run):
    """Attempt 2 started 5 s after attempt 1's ranks dumped (within the start's slack for file
    times): rank 1's old dump, behind, must not be read as attempt 2's evidence; each dump
    names its attempt (`flight.ATTEMPT_KEY`)."""
    from mscale.distributed.flight import ATTEMPT_KEY, GROUPS_KEY

    def dump(attempt: int, seq: int, t: float) -> str:
        entry = {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
                 "is_p2p": False, "time_created_ns": int(t * 1e9), "timeout_ms": 5000}
        return json.dumps({"entries": [entry], GROUPS_KEY: {"0": [0, 1, 2]},
                           ATTEMPT_KEY: attempt})
    run.start(0.0, attempt=1)
    run.file("logs/flight_recorder_rank1.json", dump(1, 3, 9.0), t=9)
    run.start(14.0, attempt=2)
    for rank in (0, 2):
        run.file(f"logs/flight_recorder_rank{rank}.json", dump(2, 8, 30.0), t=30)
    ev = collect(run.path)
    assert sorted(r for _, r, doc in ev.flight if doc) == [0, 2]


def test_a_pickled_flight_recorder_dump_is_named_but_never_unpickled(run, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    run.start(0.0)
    run.file("logs/nccl_trace_rank_2", pickle.dumps(Exploit()), t=5)
    d = diagnose(run.path)
    assert not marker.exists()
    assert any(e.source == "logs/nccl_trace_rank_2" and "pickle" in e.text and e.rank == 2
               for e in d.evidence)


def test_only_the_last_attempt_counts(run):
    """Attempt 1 was killed (its peers' error files stay on disk); attempt 2 resumed and hung:
    the old files must not be read as the new failure."""
    rid1 = run.start(0.0, attempt=1)
    for rank in (0, 1, 3):
        run.error_file(rank, 5, "network", GLOO_RESET)
    run.launcher_stop(6, rid1, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    rid2 = run.start(101, attempt=2)
    run.event("info", 102, message="plan changed on restart")  # train writes it after the start
    run.error_file(0, 120, "timeout", GLOO_TIMEOUT)
    run.error_file(1, 120, "timeout", GLOO_TIMEOUT)
    run.error_file(2, 120, "timeout", GLOO_TIMEOUT)
    run.launcher_stop(121, rid2, 0, "exited with code 3", "timeout", [3, 3, 3, -9],
                      timed_out=[0, 1, 2], stopped=[3], hang=[3])
    d = diagnose(run.path)
    assert (d.attempt, d.symptom, d.suspect_ranks) == (2, "hang", [3])
    assert not any("SIGKILL" in e.text for e in d.evidence)
    ev = collect(run.path)
    assert ev.attempt.run_id == rid2
    assert [e["kind"] for e in ev.attempt.events] == ["start", "info", "hang"]


def test_an_old_error_file_does_not_outlive_a_finished_attempt(run):
    rid1 = run.start(0.0, attempt=1)
    run.error_file(1, 5, "crash", "ValueError: boom")
    run.launcher_stop(6, rid1, 1, "exited with code 3", "crash", [3, 3, 3, 3])
    rid2 = run.start(50, attempt=2)
    run.finish(60, 0, 8, rid2)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.attempt, d.exit_code) == ("none", "finished", 2, 0)


def test_an_attempt_that_failed_before_its_start_event(run):
    rid1 = run.start(0.0, attempt=1)
    run.finish(10, 1, 5, rid1, reason="halt")
    run.error_file(0, 20, "bad_input", "plan.yaml: layout.tp must divide the heads; fix: ...")
    run.launcher_stop(21, "local-0002", 0, "exited with code 3", "bad_input", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.attempt, d.cls, d.symptom) == (2, "user_code", "bad_input")


def test_damaged_files_are_evidence_not_a_crash(run):
    rid = run.start(0.0)
    with open(run.root / "events.jsonl", "a") as f:
        f.write('{"kind": "stop", "truncat\n')
    run.file("logs/rank2.error.json", "{not json", t=5)
    run.file("preflight.json", "[1, 2", t=1)
    run.file("quarantine.json", json.dumps({"entries": [{"node": "node2", "reason": "watch: "
                                                         "slow node"}]}))
    (run.root / "plan.yaml").write_text("layout: [unclosed\n")
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert d.symptom == "signal" and d.suspect_ranks == [2]
    sources = {e.source for e in d.evidence}
    assert {"events.jsonl", "logs/rank2.error.json", "preflight.json", "plan.yaml",
            "quarantine.json"} <= sources


def test_a_deeply_nested_dump_is_a_problem_not_a_crash(run):
    """json.loads raises RecursionError (not a ValueError) on deep nesting: recover stopped
    with 'internal error' on a 400 KB flight-recorder dump."""
    run.start(0.0)
    run.file("logs/flight_recorder_rank0.json",
             '{"entries": ' + "[" * 200_000 + "]" * 200_000 + "}", t=5)
    d = diagnose(run.path)
    assert any(e.source == "logs/flight_recorder_rank0.json" and "nested" in e.text
               for e in d.evidence)


def test_logs_are_read_from_their_tail_only(run, monkeypatch):
    monkeypatch.setattr(read, "LOG_TAIL_BYTES", 4096)
    monkeypatch.setattr(read.read_tail, "__defaults__", (4096, None))
    run.start(0.0)
    head = "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    run.log(1, head + "step ok\n" * 20_000 + "torch.OutOfMemoryError: CUDA out of memory.\n")
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("software", "oom")  # the head's GPU fault was never read
    assert not any("illegal memory" in e.text for e in d.evidence)


def test_invalid_utf8_is_read_with_replacement(run):
    run.start(0.0)
    run.file("logs/rank0.log", b"\xff\xfe garbage \x80\nNVRM: Xid (PCI:0000:3b:00): 79, GPU "
             b"has fallen off the bus.\n")
    d = diagnose(run.path)
    assert d.cls == "gpu" and d.suspect_ranks == [0]


def test_an_earlier_attempts_error_file_and_log_are_not_this_failure(run):
    """Attempt 1 ran out of memory on rank 1 (its error file and log stay on disk, rank 1 did
    not fail again); attempt 2 lost rank 2 to SIGKILL: the OOM must not outweigh it."""
    rid1 = run.start(0.0, attempt=1)
    run.error_file(1, 5, "crash", "torch.OutOfMemoryError: CUDA out of memory.")
    run.log(1, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n", t=5)
    run.launcher_stop(6, rid1, 1, "exited with code 3", "crash", [3, 3, 3, 3])
    rid2 = run.start(200, attempt=2)
    run.error_file(0, 210, "network", GLOO_RESET)
    run.error_file(3, 210, "network", GLOO_RESET)
    run.launcher_stop(211, rid2, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert (d.attempt, d.cls, d.symptom, d.suspect_ranks) == (2, "unknown", "signal", [2])
    assert not any("out of memory" in e.text or "Xid" in e.text for e in d.evidence)


def test_error_files_older_than_the_attempt_are_not_read(run, monkeypatch):
    """After a job-wide timeout every rank has an error file; those an earlier attempt left
    (modified well before this one began) are skipped unread, the rest read together, a file
    server's clock a few minutes behind rank 0's included."""
    import os

    from tests.unit.recover.diag_runs import T0

    rid1 = run.start(0.0, attempt=1)
    for rank in range(3):
        run.error_file(rank, 5, "network", GLOO_RESET)
        path = run.root / "logs" / f"rank{rank}.error.json"
        os.utime(path, (T0 + 5, T0 + 5))
    run.launcher_stop(6, rid1, 1, "exited with code 3", "crash", [3, 3, 3, 3])
    rid2 = run.start(2000, attempt=2)
    run.error_file(3, 2010, "crash", "torch.OutOfMemoryError: CUDA out of memory.")
    fresh = run.root / "logs" / "rank3.error.json"  # the file server's clock 5 minutes behind
    os.utime(fresh, (T0 + 1710, T0 + 1710))
    run.launcher_stop(2011, rid2, 2, "exited with code 3", "crash", [0, 0, 0, 3])
    seen = []
    real = read.read_json
    monkeypatch.setattr(read, "read_json", lambda info, *a: seen.append(info.source)
                        or real(info, *a))
    d = diagnose(run.path)
    assert [s for s in seen if s.endswith(".error.json")] == ["logs/rank3.error.json"]
    assert (d.attempt, d.symptom, d.suspect_ranks) == (2, "oom", [3])


def test_a_run_directory_on_an_object_store():
    """Events appended as one object per record (runs/atomic.py) and files read through fsspec."""
    import uuid

    from mscale.runs.atomic import append_line, write_json_atomic

    root = f"memory://diag-{uuid.uuid4().hex}"
    append_line(f"{root}/events.jsonl", json.dumps(
        {"time": 100.0, "source": "train", "kind": "start",
         "evidence": {"run_id": "slurm-1", "attempt": 3, "launcher": "slurm"}}))
    write_json_atomic(f"{root}/logs/rank5.error.json", {
        "rank": 5, "node": "gpu7", "time": 120.0, "kind": "crash",
        "message": "RuntimeError: CUDA error: an illegal memory access was encountered"})
    append_line(f"{root}/events.jsonl", json.dumps(
        {"time": 121.0, "source": "train", "kind": "stop", "ranks": [0],
         "evidence": {"kind": "network", "error_file": "logs/rank0.error.json"}}))
    d = diagnose(root)
    assert (d.cls, d.symptom, d.attempt, d.suspect_ranks, d.suspect_nodes, d.exit_code) == \
        ("gpu", "crash", 3, [5], ["gpu7"], 3)


def test_records_of_the_wrong_shape_are_problems_not_crashes(run):
    rid = run.start(0.0)
    for step in (30, 30, 35):  # two spikes at the same step: equal keys must not be compared
        run.event("grad_spike", step, source="watch", step=step, evidence={"first_step": step})
    run.event("divergence", 40, source="watch", step=40, evidence={"first_bad_step": "soon"})
    run.event("stop", 41, evidence={"first_failed_rank": [1], "how": 7})
    run.event("nan", 42, evidence="not a dict", step="x")
    run.error_file(1, 30, "crash", "ValueError: x")
    (run.root / "logs" / "rank1.error.json").write_text(json.dumps(
        {"rank": 1, "time": 1796000030.0, "kind": ["crash"], "message": {"a": 1},
         "traceback": 5}))
    d = diagnose(run.path)
    assert d.cls in ("numerics", "software", "unknown")  # and no exception
    assert d.attempt == 1


def test_a_start_event_with_damaged_evidence(run):
    run.event("start", 0, evidence="garbled")
    run.event("stop", 5, evidence=["garbled"])
    d = diagnose(run.path)
    assert d.attempt == 1 and d.cls == "unknown"


def test_the_same_gloo_line_from_many_ranks_is_one_evidence_line(run):
    """Every peer of a killed rank writes its own ``Connection closed by peer [ADDR]:PORT``;
    ports, addresses and the kind's prefix aside they are one line, naming the other ranks."""
    rid = run.start(0.0)
    for rank, port in ((0, 56194), (1, 22454), (3, 53387)):
        run.error_file(rank, 5 + rank / 100, "network",
                       GLOO_RESET.replace("45453", str(port)).replace("pair.cc:537",
                                                                      f"pair.cc:{530 + rank}"))
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    lines = [e for e in diagnose(run.path).evidence if "Connection reset" in e.text]
    assert len(lines) == 1, [e.text for e in lines]
    assert (lines[0].rank, lines[0].also_ranks) == (0, [1, 3])


def test_a_checkpoint_failure_is_one_line_not_one_per_rule(run):
    rid = run.start(0.0)
    run.event("checkpoint_failed", 4, step=8, severity="critical",
              message="checkpoint step-000008 failed on 4 rank(s): OSError: [Errno 28] No space "
                      "left on device", evidence={"errors": {"0": "OSError: [Errno 28] No space "
                                                                  "left on device"}})
    run.finish(5, 3, 9, rid, reason="abort")
    d = diagnose(run.path)
    assert d.symptom == "disk_full"
    assert sum("step-000008 failed" in e.text for e in d.evidence) == 1
    assert not any(e.text.startswith("OSError") for e in d.evidence)


def test_an_unreadable_events_file_is_a_problem_not_silence(run):
    (run.root / "events.jsonl").mkdir()
    (run.root / "events.jsonl.d").mkdir()
    (run.root / "events.jsonl.d" / "000001.jsonl").write_text(
        json.dumps({"kind": "nan", "source": "train", "time": 1.0, "step": 3}) + "\n")
    d = diagnose(run.path)
    assert d.symptom == "nan"  # the readable segment still counts
    assert any(e.source == "events.jsonl" and "unreadable" in e.text for e in d.evidence)


def test_a_run_stopped_before_its_first_step_has_no_metrics_and_that_is_no_problem(run):
    """No metrics.jsonl is what a job that never finished a step leaves: not evidence of a
    damaged run directory."""
    run.start(0.0)
    run.error_file(0, 1.0, "crash", "RuntimeError: boom")
    d = diagnose(run.path)
    assert not [e for e in d.evidence if e.source == "metrics.jsonl"], d.evidence
