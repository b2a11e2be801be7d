"""A worker's view of its launcher's death and of a closed console, as recover will read it
(train/failure.py, train/worker.py, train/progress.py), without starting a job."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from mscale.config.records import MetricsRecord
from mscale.runs.atomic import read_jsonl
from mscale.runs.rundir import RunDir
from mscale.train.failure import (classify, launcher_gone_line, launcher_gone_message,
                                  read_error_files, record_launcher_gone)
from mscale.train.progress import ProgressReporter
from mscale.train.worker import launcher_took_it


def test_a_closed_console_is_not_a_network_fault():
    assert classify(BrokenPipeError(errno.EPIPE, "Broken pipe")) == "console"
    # between ranks, gloo says it in a RuntimeError's text: still the network
    assert classify(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                 "[127.0.0.1]:5777")) == "network"
    assert classify(RuntimeError("[pair.cc:598] Write error [127.0.0.1]:41: Broken pipe")) \
        == "network"
    assert classify(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")) \
        == "network"


@pytest.mark.parametrize("rank", [0, 1])
def test_launcher_gone_leaves_an_error_file_and_rank_0_a_stop_event(tmp_path, monkeypatch, rank):
    monkeypatch.setenv("MSCALE_RUN_ID", "local-test")
    run = RunDir(str(tmp_path))
    path = record_launcher_gone(run, rank, f"node{rank + 1}", "is gone: its connection closed")
    assert path and os.path.exists(path)
    rec = read_error_files(run)[rank]
    assert rec["kind"] == "launcher_died" and rec["node"] == f"node{rank + 1}"
    assert rec["traceback"] == "" and "launcher is gone" in rec["message"]
    events = read_jsonl(run.events) if os.path.exists(run.events) else []
    if rank == 0:
        (stop,) = events
        assert stop["kind"] == "stop" and stop["severity"] == "critical"
        assert stop["evidence"]["kind"] == "launcher_died" and stop["evidence"]["code"] == 3
        assert stop["evidence"]["run_id"] == "local-test" and not stop["ranks"]
    else:
        assert events == []  # one event for the job, not one per rank


def test_recover_reads_no_node_or_network_fault_in_what_a_stopped_worker_leaves(tmp_path):
    """recover searches error files and logs for failure text; nothing a worker whose launcher
    died writes may match it (a broken pipe, a lost connection, a killed process)."""
    from mscale.recover.diagnose.rules import TEXT_RULES

    run = RunDir(str(tmp_path))
    lines = [launcher_gone_message(why) for why in (
        "is gone: its connection to this worker closed",
        "is gone: it no longer accepts its workers' connection")]
    lines.append(launcher_gone_line(run, 3, "node2", "is gone: its connection closed"))
    for line in lines:
        assert not [r.key for r in TEXT_RULES if r.pattern.search(line)], line


class _Watch:
    """The launcher watch: ``gone`` already fired, or ``later`` within the confirm window."""

    def __init__(self, gone: bool, later: bool = False):
        self.gone = threading.Event()
        if gone:
            self.gone.set()
        self.later = later

    def wait_gone(self, timeout: float) -> bool:
        return self.gone.is_set() or self.later


def test_a_lost_peer_after_the_launcher_died_is_the_launchers_story():
    lost = RuntimeError("Connection closed by peer [127.0.0.1]:5777")
    assert launcher_took_it(_Watch(gone=True), lost)
    assert launcher_took_it(_Watch(gone=False, later=True), lost)  # the watch fires just after
    assert not launcher_took_it(_Watch(gone=False), lost)  # a real network fault
    assert not launcher_took_it(None, lost)  # torchrun, srun: no launcher watch
    assert not launcher_took_it(_Watch(gone=False, later=True), KeyError("pp"))  # a bug
    # once the watch has fired its thread is reporting and ending the process: any failure
    # here defers to it rather than race it (rank 0's stop event could be cut off)
    assert launcher_took_it(_Watch(gone=True), KeyError("pp"))


def _record(step: int) -> MetricsRecord:
    z = [0.1, 0.1]
    return MetricsRecord(step=step, time=0.0, loss=5.5, grad_norm=0.8, clip_threshold=1.0,
                         lr=1e-3, tokens=1024, tokens_per_s=1e4, mfu=0.01, step_time=z,
                         compute_time=z, comm_wait=z, data_time=z, bubble_time=z, comm_tp=z,
                         comm_pp=z, comm_dp=z)


def test_progress_lines_to_a_closed_console_do_not_stop_training():
    r, w = os.pipe()
    os.close(r)
    stream = os.fdopen(w, "w")
    try:
        progress = ProgressReporter(10, enabled=True, log_interval=1, stream=stream)
        with progress:
            for step in range(1, 4):
                progress.update(_record(step))  # the first write fails (EPIPE): dropped
        assert progress.stream.gone
    finally:
        stream.close()


def test_the_error_file_is_json_a_human_can_read(tmp_path):
    run = RunDir(str(tmp_path))
    path = record_launcher_gone(run, 2, "node2", "is gone: its connection closed")
    text = open(path).read()
    assert json.loads(text)["rank"] == 2 and text.endswith("\n")
