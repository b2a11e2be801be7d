"""How the job's newest attempt ended (watch/ending.py), as it recorded it, through ``mscale watch
--once``: a killed, raising or hung rank, rank 0's own stop by its reason, an interruption, a clean
finish, a relaunch; each case checks the one line an operator reads and the exit code a CI job
reads. The run is written by train's own writers (ending_runs.py); an end nobody recorded:
test_ending_unrecorded.py; a live watch: test_ending_live.py.
"""

from __future__ import annotations

import shutil

import pytest

from mscale.distributed.watcher import JobResult
from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.train.failure import report_failure, write_error_file
from mscale.train.job_watch import record_interruption
from mscale.watch.ending import MAX_REASON, job_end
from mscale.watch.sim import simulate

from tests.conftest import PLANS
from tests.unit.watch.ending_runs import (KILLED, WORLD, append_metrics, launcher_failure, once,
                                          own_stop, records, running, start, verdict)


def test_a_killed_rank_is_critical_with_its_reason_in_one_line(cli, rd):
    launcher_failure(rd, 5, -9)
    code, lines, err = once(cli, rd)
    assert code == 2, err
    assert lines == [lines[0], KILLED]  # the end is the last word, after the status line
    assert lines[0].startswith("step 15 | loss") and lines[0].endswith("open alerts 1")
    doc = verdict(cli, rd)
    assert doc["exit_code"] == 2 and doc["summary"]["worst"] == "critical"
    assert doc["summary"]["worst_open"] == "critical"
    job = doc["summary"]["job"]
    assert (job["state"], job["exit_code"], job["ranks"], job["nodes"], job["attempt"]) == (
        "crashed", 3, [5], ["node3"], 1)
    assert job["step"] == 15  # the launcher's event: the last step this launch recorded
    [stop] = [f for f in doc["findings"] if f["kind"] == "stop"]
    assert stop in doc["open"] and stop["message"] == KILLED.removeprefix("CRITICAL ")
    assert stop["severity"] == "critical" and "mscale recover" in stop["advice"]
    assert stop["last_step"] == 15


def test_the_job_end_is_not_recorded_again_as_a_watch_event(cli, rd):
    """The launcher's stop is the record; acting watch adds none of its own about it."""
    launcher_failure(rd, 5, -9)
    before = open(rd.events).read()
    code, out, err = cli("watch", rd.root, "--once")
    assert code == 2 and KILLED in out.splitlines(), out + err
    assert open(rd.events).read() == before


def test_a_rank_that_raised_names_its_error_kind(cli, rd):
    write_error_file(rd, 3, "node2", RuntimeError("boom"))
    launcher_failure(rd, 3, 3)
    code, lines, err = once(cli, rd)
    assert code == 2, err
    assert lines[-1] == ("CRITICAL job stopped: rank 3 on node2 exited with code 3 "
                        "(crash: RuntimeError: boom) (exit 3)")


def test_a_hang_the_launcher_saw_is_critical(cli, rd):
    write_error_file(rd, 0, "node1", RuntimeError("collective operation timed out"))
    launcher_failure(rd, 0, 3, stopped=(3,))
    code, lines, err = once(cli, rd)
    assert code == 2, err
    assert lines[-1] == ("CRITICAL job stopped: hang — rank(s) 3 on node2 stopped answering "
                        "(process stopped); rank 0 and others timed out waiting for them "
                        "(exit 3)")
    assert verdict(cli, rd)["summary"]["job"]["state"] == "hang"


def test_a_hang_is_named_when_the_first_rank_seen_ended_on_a_closed_connection(cli, rd):
    """On a loaded machine one poll sees ranks 0-2 all ended: rank 0 lost its connection when a
    peer that had timed out exited (network), rank 1 timed out; rank 3 is stopped. CI saw this
    read as rank 0's network failure."""
    write_error_file(rd, 0, "node1", RuntimeError("Connection closed by peer [127.0.0.1]:49537"))
    write_error_file(rd, 1, "node1", RuntimeError("Timed out waiting 4000ms for send operation "
                                                  "to complete"))
    launcher_failure(rd, 0, 3, stopped=(3,))
    _, lines, err = once(cli, rd)
    assert lines[-1] == ("CRITICAL job stopped: hang — rank(s) 3 on node2 stopped answering "
                         "(process stopped); rank 1 and others timed out waiting for them "
                         "(exit 3)"), err


def test_rank_0s_own_failure_under_srun_is_critical(cli, rd, monkeypatch, capsys):
    monkeypatch.delenv("MSCALE_LAUNCHER", raising=False)
    assert report_failure(rd, 0, "node1", RuntimeError("boom")) == 3
    capsys.readouterr()
    code, lines, err = once(cli, rd)
    assert code == 2, err
    assert lines[-1] == (f"CRITICAL job stopped: error (rank 0 on node1, crash): RuntimeError: "
                        f"boom; details in {rd.path('logs', 'rank0.error.json')} (exit 3)")


@pytest.mark.parametrize("code, reason, detail, line, exit_code", [
    (2, "nan", "loss nan",
     "CRITICAL job stopped: non-finite gradient norm at step 16 (loss nan) (exit 2)", 2),
    (3, "abort", "the disk is full",
     "CRITICAL job stopped: aborted after step 15: the disk is full (exit 3)", 2),
    (1, "halt", "a checkpoint is saved before the stop; the same command resumes",
     "WARNING job stopped: halt requested through control/halt after step 15 (exit 1)", 1),
    (1, "signal", "a checkpoint is saved before the stop; the same command resumes",
     "WARNING job stopped: a stop signal asked it to halt after step 15 (exit 1)", 1),
])
def test_rank_0s_own_stop_by_its_reason(cli, rd, code, reason, detail, line, exit_code):
    own_stop(rd, code, 15, reason, detail)
    got, lines, err = once(cli, rd)
    assert got == exit_code, err
    assert lines[-1] == line
    doc = verdict(cli, rd)
    assert doc["exit_code"] == exit_code and doc["summary"]["job"]["exit_code"] == code
    assert doc["summary"]["worst"] == ("warning" if exit_code == 1 else "critical")


def test_a_stop_signal_is_named_when_rank_0_received_it(cli, rd):
    own_stop(rd, 1, 15, "signal", "a checkpoint is saved before the stop; the same command "
             "resumes", signal="SIGINT")
    code, lines, _ = once(cli, rd)
    assert code == 1
    assert lines[-1] == ("WARNING job stopped: a stop signal (SIGINT) asked it to halt after "
                         "step 15 (exit 1)")


def test_an_interruption_without_a_checkpoint_is_a_warning_that_names_no_node(cli, rd):
    """A second Ctrl-C under --local (train/job_watch.py: record_interruption): the operator
    stopped the job; the killed workers are not a failure."""
    result = JobResult(code=3, returncodes=[-9] * WORLD, failed_rank=0,
                       alive_at_failure=list(range(1, WORLD)), stop_signal="SIGINT",
                       forced=True)
    line = record_interruption(rd, result, "local-1", rd.path("logs"))
    assert line.startswith("interrupted: a second Ctrl-C stopped the workers at once, without "
                           "a checkpoint; no checkpoint was saved yet; evidence in ")
    code, lines, _ = once(cli, rd)
    assert code == 1
    assert lines[-1].startswith("WARNING job stopped: interrupted: a second Ctrl-C")
    assert lines[-1].endswith("(exit 130)")
    job = verdict(cli, rd)["summary"]["job"]
    assert job["state"] == "interrupted" and job["nodes"] == [] and job["ranks"] == []


def test_an_interruption_names_the_checkpoint_the_same_command_resumes_from(rd):
    """After a crash between a commit and latest, the line named latest's older checkpoint,
    while the same command (--resume auto) resumes from the newer one (review, helper-79)."""
    import os

    for step in (5, 7):
        os.makedirs(rd.path(f"ckpt/step-00000{step}"))
        with open(rd.path(f"ckpt/step-00000{step}/COMMITTED"), "w") as f:
            f.write("{}")
    with open(rd.path("ckpt/latest"), "w") as f:
        f.write("step-000005")
    result = JobResult(code=3, returncodes=[-9] * WORLD, failed_rank=0,
                       alive_at_failure=list(range(1, WORLD)), stop_signal="SIGINT",
                       forced=True)
    line = record_interruption(rd, result, "local-1", rd.path("logs"))
    assert f"the last checkpoint is {rd.path('ckpt/step-000007')}; the same command" in line


def test_a_clean_finish_stays_healthy(cli, rd):
    own_stop(rd, 0, 15)
    code, lines, err = once(cli, rd)
    assert code == 0, err
    assert len(lines) == 2 and lines[0].endswith("open alerts 0")
    assert lines[1] == "OK job finished at step 15 (attempt 1, exit 0); no open alerts"
    doc = verdict(cli, rd)
    assert doc["findings"] == [] and doc["summary"]["worst"] == "ok"
    assert doc["summary"]["job"]["state"] == "finished"
    assert doc["summary"]["job"]["exit_code"] == 0


def test_a_crash_relaunched_to_a_clean_finish_is_ok(cli, rd):
    """recover relaunched from the step-10 checkpoint: the newest attempt is what counts."""
    launcher_failure(rd, 5, -9)
    start(rd, 2)
    append_metrics(rd, records(11, 30, seed=2))
    own_stop(rd, 0, 30, attempt=2)
    code, lines, err = once(cli, rd)
    assert code == 0, err
    assert not [x for x in lines if "job stopped" in x]
    assert lines[-2].startswith("step 30 | loss") and lines[-2].endswith("open alerts 0")
    assert lines[-1] == "OK job finished at step 30 (attempt 2, exit 0); no open alerts"
    doc = verdict(cli, rd)
    assert doc["exit_code"] == 0 and doc["summary"]["worst"] == "ok"
    assert doc["summary"]["job"]["attempt"] == 2 and doc["summary"]["restarts"] == 1


def test_a_relaunch_still_running_is_not_judged_by_the_crash_before_it(cli, rd):
    launcher_failure(rd, 5, -9)
    start(rd, 2)
    running(rd, 2)
    append_metrics(rd, records(11, 20, seed=2))
    code, lines, err = once(cli, rd)
    assert code == 0 and not [x for x in lines if "job stopped" in x], err
    assert verdict(cli, rd)["summary"]["job"] is None


def test_a_relaunch_that_crashed_again_names_the_newest_crash(cli, rd):
    launcher_failure(rd, 5, -9)
    start(rd, 2)
    append_metrics(rd, records(11, 20, seed=2))
    launcher_failure(rd, 2, -11, attempt=2)
    code, lines, err = once(cli, rd)
    assert code == 2, err
    assert [x for x in lines if "job stopped" in x] == [
        "CRITICAL job stopped: rank 2 on node2 killed by SIGSEGV (exit 3)"]
    assert verdict(cli, rd)["summary"]["job"]["attempt"] == 2


def test_a_job_that_failed_before_its_first_step_is_reported_not_refused(cli, tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", run.plan)
    start(run, 1)
    launcher_failure(run, 5, -9)
    code, lines, err = once(cli, run)
    assert (code, lines) == (2, [KILLED]), err
    doc = verdict(cli, run)
    assert doc["exit_code"] == 2 and doc["summary"]["job"]["state"] == "crashed"


def test_no_records_and_no_stop_is_still_nothing_to_judge(cli, tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", run.plan)
    start(run, 1)
    running(run)
    code, out, err = cli("watch", run.root, "--once", "--no-act")
    assert code == 3 and "no metrics records to judge" in err


def test_the_prometheus_severity_counts_the_end(cli, rd, tmp_path):
    launcher_failure(rd, 5, -9)
    prom = tmp_path / "watch.prom"
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--prometheus", str(prom))
    text = prom.read_text()
    assert code == 2 and f'mscale_watch_severity{{run="{rd.root}"}} 2.0' in text, text
    assert 'kind="stop"' in text


def test_an_event_without_severity_or_code_is_a_finish():
    """Another writer's bare stop (or an old one) says nothing went wrong."""
    end = job_end({"source": "train", "kind": "stop", "step": 60})
    assert (end.cause, end.severity, end.finding()) == ("finished", "ok", None)


def test_any_other_failed_stop_is_critical_with_its_own_words():
    """A stop of a reason watch does not know (a worker whose launcher died writes one) is still
    judged by its code; its message, less a leading "stopped: ", is the reason."""
    end = job_end({"source": "train", "kind": "stop", "severity": "critical",
                   "message": "stopped: the --local launcher was killed; this worker stopped "
                              "itself",
                   "evidence": {"kind": "launcher_died", "reason": "launcher_died", "code": 3}})
    assert (end.cause, end.severity, end.exit_code) == ("crashed", "critical", 3)
    assert end.finding().message == ("job stopped: the --local launcher was killed; this "
                                     "worker stopped itself (exit 3)")


def test_a_long_reason_stays_one_short_line():
    end = job_end({"source": "train", "kind": "stop", "severity": "critical",
                   "message": "error (rank 0 on node1, crash): " + "x\n" * 400})
    assert "\n" not in end.reason and len(end.reason) == MAX_REASON and end.reason[-1] == "…"


def test_a_job_that_stopped_before_writing_its_plan_is_judged_from_its_stop(cli, tmp_path):
    """Under srun, a launch refused at its start leaves only rank 0's error and its stop event:
    watch said "not a run directory"; it names the stop."""
    run = RunDir(str(tmp_path / "run"))
    report_failure(run, 0, "node1", MscaleError("the launcher started 1 processes but the plan "
                                                "needs 8", field="layout"))
    code, out, _ = cli("watch", run.root, "--once", "--no-act")
    assert code == 2 and "CRITICAL job stopped: error (rank 0 on node1, bad_input)" in out


def test_a_run_re_planned_to_fewer_ranks_is_judged_attempt_by_attempt(cli, rd):
    """recover moved the run from 8 ranks to 4: plan.yaml is the new plan, RUN/plans/ keeps the
    old one. watch read every record against the new plan and stopped: 'the records have 8
    ranks, the layout 4'."""
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.runs.history import plan_change_of, write_plan

    old = load_model(Plan, rd.plan)
    new = old.model_copy(update={
        "cluster": old.cluster.model_copy(update={"nodes": 2, "hostlist": "node[1-2]"}),
        "layout": old.layout.model_copy(update={"dp": 1})})
    write_plan(rd, new, plan_change_of(rd, new))  # train's claim of recover's plan
    assert load_model(Plan, rd.plan).layout.world_size == 4
    launcher_failure(rd, 5, -9)
    start(rd, 2)
    recs = simulate(4, tp=2, pp=2, ranks_per_node=2, steps=30, seed=2)
    append_metrics(rd, [r for r in recs if r["step"] >= 11])
    own_stop(rd, 0, 30, attempt=2)
    code, lines, err = once(cli, rd)
    assert code == 0, err
    assert lines[-1] == "OK job finished at step 30 (attempt 2, exit 0); no open alerts"
