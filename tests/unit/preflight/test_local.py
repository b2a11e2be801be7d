"""Where ``mscale preflight --local``'s worker logs go (preflight/local.py `log_dir_for`,
`launch_local`): ``RUN_DIR/logs/preflight`` for a local run directory, never a temporary
directory left behind; for a remote one a temporary directory, removed when the preflight
passes and kept (and named) when it does not. The workers are faked: the real launcher writes
``rank<N>.log`` into the directory it is given (tests/unit/distributed/test_forkserver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid

import fsspec
import pytest

from mscale.cli.options import build
from mscale.config.preflight import CheckResult
from mscale.distributed.watcher import JobResult
from mscale.preflight import local
from mscale.preflight.options import PreflightOptions
from mscale.preflight.report import finish, publish
from mscale.topology.placement import load_checked_plan
from tests.conftest import PLANS

PLAN = str(PLANS / "cpu-tiny.yaml")


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """The system temporary directory, redirected to one this test can watch."""
    where = tmp_path / "system-tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


def test_a_local_run_directory_keeps_the_logs_in_its_logs_folder(tmpdir_here):
    for run_dir in ("runs/pf", "/abs/runs/pf", "file:///abs/runs/pf"):
        logs, temporary = local.log_dir_for(run_dir)
        assert not temporary
        assert logs == os.path.join(run_dir.removeprefix("file://"), "logs", "preflight")
    assert list(tmpdir_here.iterdir()) == []  # nothing made in the system temporary directory


def test_a_remote_run_directory_gets_a_local_temporary_directory(tmpdir_here):
    logs, temporary = local.log_dir_for("memory://pf/run")
    assert temporary and os.path.isdir(logs)
    assert os.path.dirname(logs) == str(tmpdir_here)
    assert os.path.basename(logs).startswith("mscale-logs-")


def _job(plan, status: str, failed_rank: int | None = None):
    """A fake `run_local_workers`: writes each rank's log where it is told and, unless a rank
    fails, rank 0's report with ``status``; returns the launcher's view of the job."""
    seen = {}

    def run(nprocs, gpus_per_node, worker_args, log_dir, extra_env, **kw):
        seen["log_dir"], seen["env"], seen["settings"] = log_dir, extra_env, kw
        os.makedirs(log_dir, exist_ok=True)
        for r in range(nprocs):
            with open(os.path.join(log_dir, f"rank{r}.log"), "w") as f:
                f.write(f"rank {r} output\n")
        if failed_rank is None:
            opts = PreflightOptions.model_validate_json(extra_env[local.OPTIONS_ENV])
            result = CheckResult(check="gemm", entity_kind="rank", entity="rank 0",
                                 node="node0", ranks=[0], status=status)
            publish(finish(plan, opts, nprocs, [result], {}), opts, quiet=True)
            return JobResult(code=0, returncodes=[0] * nprocs)
        codes = [3] * nprocs
        codes[failed_rank] = -9
        return JobResult(code=3, returncodes=codes, failed_rank=failed_rank)

    return run, seen


def _launch(monkeypatch, run_dir: str, status: str = "OK", failed_rank: int | None = None):
    plan = load_checked_plan(PLAN)
    run, seen = _job(plan, status, failed_rank)
    monkeypatch.setattr(local, "run_local_workers", run)
    opts = build(PreflightOptions, {"as_json": True}, run_dir=run_dir, plan_path=PLAN)
    code = local.launch_local(PLAN, plan, opts, plan.layout.world_size)
    return code, seen


def test_local_workers_log_into_the_run_directory_and_a_second_preflight_rewrites_them(
        tmp_path, tmpdir_here, monkeypatch, capsys):
    run = tmp_path / "runs" / "pf"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank3.log").write_text("a failed training attempt's log\n")
    code, seen = _launch(monkeypatch, str(run))
    logs = run / "logs" / "preflight"
    assert code == 0 and seen["log_dir"] == str(logs)
    assert seen["env"]["MSCALE_PREFLIGHT_LOGS"] == str(logs)
    assert sorted(os.listdir(logs)) == [f"rank{r}.log" for r in range(8)]
    assert f"worker logs in {logs}\n" in capsys.readouterr().err
    assert list(tmpdir_here.iterdir()) == []  # the old code left /tmp/mscale-preflight-logs-* behind
    # train's logs are recover's evidence: a preflight never writes over them
    assert (run / "logs" / "rank3.log").read_text() == "a failed training attempt's log\n"
    # a second preflight into the same run directory: the same files, rewritten (as train does)
    code, seen = _launch(monkeypatch, str(run), failed_rank=5)
    assert code == 2 and seen["log_dir"] == str(logs)
    assert sorted(os.listdir(logs)) == [f"rank{r}.log" for r in range(8)]
    assert list(tmpdir_here.iterdir()) == []


def test_a_remote_run_directorys_temporary_logs_go_when_the_preflight_passes(
        tmpdir_here, monkeypatch, capsys):
    run_dir = f"memory://pf-{uuid.uuid4().hex}/run"
    code, seen = _launch(monkeypatch, run_dir)
    assert code == 0 and os.path.dirname(seen["log_dir"]) == str(tmpdir_here)
    assert not os.path.exists(seen["log_dir"]) and list(tmpdir_here.iterdir()) == []
    assert fsspec.filesystem("memory").isfile(run_dir.removeprefix("memory://") +
                                              "/preflight.json")
    assert "kept" not in capsys.readouterr().err


@pytest.mark.parametrize("status, failed_rank", [("CRITICAL", None), ("WARNING", None),
                                                 ("OK", 5)])
def test_a_remote_run_directorys_temporary_logs_stay_and_are_named_when_it_fails(
        tmpdir_here, monkeypatch, capsys, status, failed_rank):
    run_dir = f"memory://pf-{uuid.uuid4().hex}/run"
    code, seen = _launch(monkeypatch, run_dir, status, failed_rank)
    assert code != 0
    logs = seen["log_dir"]
    assert sorted(os.listdir(logs)) == [f"rank{r}.log" for r in range(8)]
    err = capsys.readouterr().err
    assert f"preflight: worker logs kept in {logs}\n" in err, err


FORKED_WORKER = ("import sys, warnings\n"
                 "from multiprocessing import spawn\n"
                 "warnings.simplefilter('error')\n"
                 "for name in sys.argv[1:]: __import__(name)\n"  # the fork server's preload
                 "spawn.prepare({'init_main_from_name': 'mscale.cli.main'})\n")
"""What the fork server and then each worker forked from it do, for a launcher started as
``python -m mscale.cli.main``, before the worker's entry runs (multiprocessing's spawn._main):
the launcher's ``__main__`` re-run through runpy, its warnings made errors."""


def test_the_workers_preload_leaves_python_m_mscale_cli_main_a_clean_start(tmp_path, tmpdir_here,
                                                                           monkeypatch):
    """``python -m mscale.cli.main preflight --local 8`` printed runpy's "'mscale.cli.main' found
    in sys.modules ... prior to execution" RuntimeWarning 8 times: the server had preloaded the
    module that each forked worker then re-runs as the launcher's ``__main__``."""
    _, seen = _launch(monkeypatch, str(tmp_path / "run"))
    preload = ["mscale.distributed.forkserver", *seen["settings"]["preload"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", FORKED_WORKER, *preload], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr


def test_a_worker_that_died_keeps_rank_0s_figures_in_the_launchers_report(
        tmp_path, tmpdir_here, monkeypatch, capsys):
    """Rank 0 wrote a report (UNKNOWN: its collective stopped) with the GEMM figures measured
    before; a worker was killed. The launcher's report names the dead rank and keeps them."""
    plan = load_checked_plan(PLAN)

    def run(nprocs, gpus_per_node, worker_args, log_dir, extra_env, **kw):
        opts = PreflightOptions.model_validate_json(extra_env[local.OPTIONS_ENV])
        figures = [CheckResult(check="gemm", entity_kind="rank", entity=f"rank {r}",
                               node=f"node{r // 2 + 1}", ranks=[r], value=0.03, status="OK")
                   for r in range(nprocs)]
        stop = CheckResult(check="stopped", entity_kind="job", entity="phase p2p",
                           status="UNKNOWN")
        report = finish(plan, opts, nprocs, figures + [stop], {})
        report.measured = {"gemm_tflops": {"median": 0.03}}
        publish(report, opts, quiet=True)
        codes = [0] * nprocs
        codes[5] = -9
        return JobResult(code=3, returncodes=codes, failed_rank=5)

    monkeypatch.setattr(local, "run_local_workers", run)
    opts = build(PreflightOptions, {"as_json": True}, run_dir=str(tmp_path / "run"),
                 plan_path=PLAN)
    assert local.launch_local(PLAN, plan, opts, 8) == 2
    report = json.loads(capsys.readouterr().out)
    assert sum(r["check"] == "gemm" for r in report["results"]) == 8
    assert [(r["entity"], r["node"]) for r in report["results"]
            if r["check"] == "rank_alive"] == [("rank 5", "node3")]
    assert report["exclude"] == "node3" and report["measured"]["gemm_tflops"]["median"] == 0.03
