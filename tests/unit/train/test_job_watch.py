"""Whether the operator's stop explains a --local job's abnormal ends
(train/job_watch.py `stopped_by_operator`): an interruption names no node; anything a stop does
not explain stays a failure."""

from __future__ import annotations

from mscale.distributed.watcher import JobResult
from mscale.train.job_watch import stopped_by_operator


def _stopped(codes, forced=False, stop="SIGINT"):
    failed = next((r for r, c in enumerate(codes) if c not in (None, 0, 1, 2)), None)
    return JobResult(code=3, returncodes=codes, failed_rank=failed, stop_signal=stop,
                     forced=forced)


def test_a_stop_explains_interrupted_and_killed_workers_and_their_lost_peers():
    assert stopped_by_operator(_stopped([130, -15, 3]), {2: {"kind": "network"}})
    assert stopped_by_operator(_stopped([-9, -9], forced=True), {})


def test_a_crash_or_an_oom_kill_near_a_stop_stays_a_failure():
    assert not stopped_by_operator(_stopped([130, 3]), {1: {"kind": "crash"}})
    assert not stopped_by_operator(_stopped([130, -11]), {})  # a segfault
    assert not stopped_by_operator(_stopped([1, -9]), {})  # killed, and nobody forced it
    assert not stopped_by_operator(_stopped([130, -15], stop=None), {})  # failed before the stop


def test_an_earlier_attempts_error_file_is_not_this_jobs(tmp_path):
    """A relaunched job's launcher quoted attempt 1's rank 5 error (a network error) as the
    cause of attempt 2's kill of rank 5: only files written since the job's start are its."""
    import json
    import time

    from mscale.runs.rundir import RunDir
    from mscale.train.failure import read_error_files

    run = RunDir(str(tmp_path))
    logs = tmp_path / "logs"
    logs.mkdir()
    now = time.time()
    for rank, when in ((5, now - 60), (2, now + 1)):
        (logs / f"rank{rank}.error.json").write_text(json.dumps({"rank": rank, "time": when}))
    (logs / "rank3.error.json").write_text(json.dumps({"rank": 3}))  # no time: not provably new
    assert sorted(read_error_files(run)) == [2, 3, 5]
    assert sorted(read_error_files(run, since=now)) == [2]
    # a launch's own files name it: theirs whatever the clocks say, another launch's never
    (logs / "rank6.error.json").write_text(json.dumps({"rank": 6, "time": now - 60,
                                                       "run_id": "local-b"}))
    (logs / "rank7.error.json").write_text(json.dumps({"rank": 7, "time": now + 1,
                                                       "run_id": "local-a"}))
    assert sorted(read_error_files(run, since=now, run_id="local-b")) == [2, 6]


def test_the_launchers_event_names_this_launchs_last_step_only(tmp_path):
    """A job that died before its first record must not be given an earlier attempt's step."""
    import json

    from mscale.runs.rundir import RunDir
    from mscale.train.job_watch import last_step_since

    run = RunDir(str(tmp_path))
    lines = [json.dumps({"step": s, "time": 100.0 + s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 4, \"ti")  # torn
    assert last_step_since(run, since=50.0) == 3
    assert last_step_since(run, since=500.0) is None  # written before this launch
    assert last_step_since(RunDir(str(tmp_path / "none")), since=50.0) is None


def test_a_full_disks_agreed_stop_is_no_rank_failing_first(tmp_path):
    """Every rank exits 3 at one boundary after rank 0's `stopped at step 187: ... the disk is
    full` line, and the full disk kept its stop event and the error files out: the launcher
    added `failed: rank 0 on node1 exited with code 3 first` and a critical event naming
    node1. Rank 0's last line says the stop was agreed; anything less stays a failure."""
    from mscale.runs.rundir import RunDir
    from mscale.train.job_watch import agreed_stop

    run = RunDir(str(tmp_path))  # no events.jsonl: nothing could be written
    said = "stopped at step 187: RUN/metrics.jsonl: the disk is full (no space left): ..."

    def result(codes, line=said):
        return JobResult(code=3, returncodes=codes, failed_rank=0, rank0_last_line=line)

    assert agreed_stop(run, result([3, 3]), "local-a", {})
    assert not agreed_stop(run, result([3, 3], line="step 186/400  loss 3.7"), "local-a", {})
    assert not agreed_stop(run, result([3, -9]), "local-a", {})  # a rank killed: a failure
    assert not agreed_stop(run, result([3, 3]), "local-a", {1: {"kind": "crash"}})
