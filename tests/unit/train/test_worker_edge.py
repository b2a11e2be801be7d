"""The worker's edge and the launcher's view of a failure, without starting a job."""

from __future__ import annotations

import errno
import json
import math
import os

import pytest

from mscale.config.training import TrainingConfig
from mscale.distributed.lifeline import LOG_FILE_ENV
from mscale.errors import MscaleError
from mscale.runs.atomic import DiskFullError
from mscale.runs.rundir import RunDir
from mscale.train.console import Summary, stop_line
from mscale.train.control import Control
from mscale.train.failure import classify, read_error_files, report_failure, write_error_file
from mscale.distributed.watcher import describe_exit
from mscale.train.job_watch import JobResult
from mscale.train.loop import with_steps
from mscale.train.schedule import learning_rate
from mscale.train.worker import default_threads


@pytest.mark.parametrize("exc, kind", [
    (MscaleError("bad plan"), "bad_input"),
    (DiskFullError("full"), "disk_full"),
    (OSError(errno.ENOSPC, "No space left on device"), "disk_full"),
    (RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete"), "timeout"),
    (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), "network"),
    (RuntimeError("[pair.cc:598] Write error [127.0.0.1]:1234: Broken pipe"), "network"),
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), "console"),  # its stdout/stderr, not a peer
    (ZeroDivisionError("division by zero"), "crash"),
])
def test_failures_are_classified_for_recover(exc, kind):
    assert classify(exc) == kind


def test_a_crash_is_exit_3_with_an_error_file_never_1(tmp_path, capsys):
    run = RunDir(str(tmp_path))
    try:
        raise KeyError("pp")
    except KeyError as e:
        code = report_failure(run, 5, "node3", e)
    assert code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 5 on node3, crash" in err and "rank5.error.json" in err
    rec = read_error_files(run)[5]
    assert rec["kind"] == "crash" and rec["node"] == "node3" and "KeyError" in rec["traceback"]


GLOO_CLOSED = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc"
                           ":553] Connection closed by peer [127.0.0.1]:40321")


def test_a_lost_peer_under_local_goes_to_the_log_not_before_the_launchers_line(
        tmp_path, capsys, monkeypatch):
    """rank 0's console is the launcher's: its 'network' line used to come first there, before
    the launcher's line naming the rank that really failed."""
    log = tmp_path / "rank0.log"
    monkeypatch.setenv("MSCALE_LAUNCHER", "local")
    monkeypatch.setenv(LOG_FILE_ENV, str(log))
    assert report_failure(RunDir(str(tmp_path)), 0, "node1", GLOO_CLOSED) == 3
    assert capsys.readouterr().err == ""
    assert log.read_text().startswith("error (rank 0 on node1, network): RuntimeError: "
                                      "Connection closed by peer")  # no C++ source location
    assert "pair.cc:553" in read_error_files(RunDir(str(tmp_path)))[0]["message"]  # kept whole


def test_a_lost_peer_under_srun_is_said_on_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MSCALE_LAUNCHER", raising=False)
    report_failure(RunDir(str(tmp_path)), 3, "node2", GLOO_CLOSED)
    assert "error (rank 3 on node2, network): RuntimeError: Connection" in capsys.readouterr().err


@pytest.mark.parametrize("launcher", ["srun", "local"])
def test_a_second_ctrl_c_is_130_and_rank_0_records_it_where_no_launcher_does(
        tmp_path, capsys, monkeypatch, launcher):
    monkeypatch.setenv("MSCALE_LAUNCHER", launcher)
    log = tmp_path / "rank0.log"
    monkeypatch.setenv(LOG_FILE_ENV, str(log))
    run = RunDir(str(tmp_path))
    assert report_failure(run, 0, "node1", KeyboardInterrupt()) == 130
    events = [json.loads(x) for x in open(run.events)] if os.path.exists(run.events) else []
    if launcher == "local":  # the launcher says it (one reason line) and writes its own event,
        assert capsys.readouterr().err == ""  # with every rank's code; the rank's log has it
        assert log.read_text() == "rank 0: interrupted\n" and events == []
    else:
        assert capsys.readouterr().err == "rank 0: interrupted\n"
        assert [(e["kind"], e["evidence"]["reason"], e["evidence"]["code"]) for e in events] \
            == [("stop", "interrupted", 130)]


def test_a_damaged_checkpoint_is_3_for_train_not_the_nan_code(tmp_path, capsys):
    assert report_failure(RunDir(str(tmp_path)), 0, "n", MscaleError("x", code=2)) == 3


def test_error_file_on_a_full_disk_does_not_hide_the_failure(tmp_path):
    (tmp_path / "logs").write_text("a file where the logs directory should be")
    assert write_error_file(RunDir(str(tmp_path)), 0, "n", RuntimeError("boom")) is None


def test_default_threads_share_the_cores():
    assert default_threads(8, cpus=2) == 1 and default_threads(2, cpus=16) == 8
    assert default_threads(1, cpus=4) == 4


def test_steps_override_lays_the_schedule_over_the_new_length():
    cfg = TrainingConfig(global_batch=8, steps=40, warmup_steps=10, lr=1.0, min_lr=0.1)
    short = with_steps(cfg, 20)
    assert short.steps == 20 and short.warmup_steps == 5
    assert math.isclose(learning_rate(short, 4), 1.0)  # peak at the end of the scaled warm-up
    assert math.isclose(learning_rate(short, 20), 0.1)  # decays to min_lr by the last step
    assert with_steps(cfg, 40) is cfg


def test_a_control_entry_of_any_kind_is_a_request(tmp_path):
    ctl = tmp_path / "control"
    (ctl / "halt").mkdir(parents=True)
    (ctl / "halt" / "note").write_text("operator")
    d = Control(str(ctl), rank=0).poll()
    assert d.halt and d.stop and not (ctl / "halt").exists()


def test_abort_flag_stops_every_rank():
    d = Control(None, rank=0).poll(abort=True)
    assert d.abort and d.stop and not d.checkpoint


def test_console_lines_say_why_and_where():
    line = stop_line("nan", 7, "R/events.jsonl", "loss nan")
    assert "step 7" in line and "non-finite" in line and "R/events.jsonl" in line
    assert "evidence" not in stop_line("abort", 3, None, "the disk is full")
    assert Summary(first_step=4).line(None, "R").startswith("no step trained (at step 4)")


def test_how_a_worker_ended():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exited with code 3"
    assert JobResult(code=0, returncodes=[0]).failed_rank is None


def test_rank_0s_own_stop_event_under_srun_names_the_launch(tmp_path, monkeypatch, capsys):
    """Under srun nobody else records the stop; recover tells attempts apart by run id, also for
    one that failed before its start event."""
    import json

    monkeypatch.setenv("MSCALE_LAUNCHER", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.delenv("MSCALE_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    run = RunDir(str(tmp_path))
    assert report_failure(run, 0, "node1", RuntimeError("boom")) == 3
    (event,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["kind"] == "stop" and event["evidence"]["run_id"] == "slurm-41"


@pytest.mark.parametrize("exc, kind, names", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:4"),
     "stop", False),
    (RuntimeError("Wait timeout after 30000ms"), "hang", False),
    (RuntimeError("boom"), "stop", True)])
def test_rank_0s_view_of_a_peers_failure_names_no_node(tmp_path, monkeypatch, capsys, exc, kind,
                                                      names):
    """Under srun a task killed on node3 reaches rank 0 as a closed connection: rank 0's stop
    event must not name rank 0's node as the failure (watch's stop line would blame node1).
    Its own crash still names it."""
    import json

    from mscale.watch.ending import job_end

    monkeypatch.setenv("MSCALE_LAUNCHER", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    run = RunDir(str(tmp_path))
    assert report_failure(run, 0, "node1", exc) == 3
    (event,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["kind"] == kind and event["evidence"]["observer"] == {"rank": 0, "node": "node1"}
    end = job_end(event)
    assert end.severity == "critical" and end.exit_code == 3
    if names:
        assert event["nodes"] == ["node1"] and end.nodes == ["node1"]
    else:
        assert event["nodes"] == [] and event["ranks"] == [] and end.nodes == []
        assert "rank 0 on node1" in end.line() and "peer" in end.line(), end.line()
        assert "pair.cc" not in end.line()


def test_rank_0s_failed_start_is_reported_before_its_peers_are_told(tmp_path, capsys):
    """agree_on_rank0 reports rank 0's error (line and error file) before the broadcast that
    lets its peers exit: a --local launcher stops every worker once one has exited, and rank 0
    was stopped before it had said why. The edge then only exits with the reported code."""
    from mscale.train.failure import ReportedFailure
    from mscale.train.session import agree_on_rank0

    run, said = RunDir(str(tmp_path)), []

    def report(exc):
        said.append(exc)
        return ReportedFailure(report_failure(run, 0, "node1", exc))

    def bad():
        raise MscaleError("data_skip.json: damaged", field="entries")

    with pytest.raises(ReportedFailure) as e:
        agree_on_rank0(bad, 0, report=report)
    assert e.value.code == 3
    assert len(said) == 1 and "data_skip.json" in capsys.readouterr().err
    assert (tmp_path / "logs" / "rank0.error.json").exists()
    assert agree_on_rank0(lambda: 7, 0, report=report) == 7 and len(said) == 1


def test_a_ctrl_c_that_pydantic_wrapped_at_start_up_is_130_not_a_crash(tmp_path, capsys,
                                                                        monkeypatch):
    """A worker's Ctrl-C while pydantic built a schema came out as a SchemaError: exit 3,
    reported as a crash of rank 0's node."""
    from tests.unit.cli.test_main import _schema_error_of_a_ctrl_c

    monkeypatch.setenv("MSCALE_LAUNCHER", "srun")
    run = RunDir(str(tmp_path))
    assert report_failure(run, 0, "node1", _schema_error_of_a_ctrl_c()) == 130
    assert capsys.readouterr().err == "rank 0: interrupted\n"
