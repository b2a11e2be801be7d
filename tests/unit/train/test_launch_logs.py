"""Where `mscale train --local`'s worker logs go (train/launch.py, distributed/launch.py
`worker_log_dir`): RUN_DIR/logs for a local run directory; for a remote one a local temporary
directory, removed after a job that ended well and named after one that did not (it used to be
left in /tmp after every run)."""

from __future__ import annotations

import os
import tempfile

from mscale.distributed.launch import worker_log_dir
from mscale.errors import MscaleError
from mscale.train import launch


def test_a_local_run_directory_keeps_its_logs(tmp_path):
    for run_dir in ("runs/r", "/abs/runs/r", "file:///abs/runs/r"):
        assert worker_log_dir(run_dir, "logs") == (os.path.join(
            run_dir.removeprefix("file://"), "logs"), False)


def test_a_remote_run_directory_logs_to_a_temporary_one_tidied_by_the_outcome(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kept, temporary = worker_log_dir("memory://bucket/run", "logs")
    assert temporary and os.path.dirname(kept) == str(tmp_path)
    launch._tidy_logs(kept, temporary, passed=False)
    assert os.path.isdir(kept) and f"worker logs kept in {kept}" in capsys.readouterr().err
    gone, _ = worker_log_dir("s3://bucket/run", "logs")
    launch._tidy_logs(gone, True, passed=True)
    assert not os.path.exists(gone) and os.listdir(tmp_path) == [os.path.basename(kept)]
    launch._tidy_logs(str(tmp_path), False, passed=True)  # a run directory's own: never removed
    assert os.path.isdir(tmp_path)



def test_an_inherited_omp_num_threads_that_oversubscribes_the_cores_is_noted():
    from mscale.train.launch import oversubscription_note

    note = oversubscription_note("2", 8, 2)
    assert note.startswith("note: OMP_NUM_THREADS=2 (from the environment) gives 8 workers 16 "
                           "threads on 2 cores")
    for omp, nprocs, cpus in (("1", 8, 2), ("2", 8, 16), (None, 8, 2), ("", 8, 2), ("x", 8, 2),
                              ("4", 2, 8)):
        assert oversubscription_note(omp, nprocs, cpus) is None, (omp, nprocs, cpus)


def test_the_launcher_abandons_its_job_when_its_run_lock_is_taken_over(tmp_path):
    """Its workers run under its lock and never look at it: the launcher's `abandon` says why
    once the heartbeat found the lock another job's, and nothing before."""
    from mscale.runs.lock import RunLock
    from mscale.train.launch import lock_lost

    lock = RunLock(str(tmp_path / "run"), "mine").acquire()
    try:
        ask = lock_lost(lock)
        assert ask() is None
        lock.lost = MscaleError("this job's run-directory lock was taken over by another job\n"
                                "  (details)", file="lock.json")
        assert ask() == "lock.json: this job's run-directory lock was taken over by another job"
    finally:
        lock.lost = None
        lock.release()
