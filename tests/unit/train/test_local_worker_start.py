"""How a ``--local`` training worker starts (train/launch.py, train/worker.py): the entry that
skips the CLI, its one-line errors, and the start-up phases the launcher shows. No processes."""

from __future__ import annotations

import pytest

from mscale.ckpt.options import CkptOptions
from mscale.train.launch import OPTIONS_ENV, WORKER_ENTRY, startup_phases
from mscale.train.options import TrainOptions
from tests.conftest import PLANS


def test_the_phases_end_ready_on_a_fresh_run(tmp_path):
    phases = startup_phases(TrainOptions(run_dir=str(tmp_path / "run")))
    assert [m for m, _ in phases] == ["imported", "rendezvous", "built", "ready"]
    assert phases[-1][1] == "ready"


def test_the_last_phase_is_the_checkpoint_load_when_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest").write_text("step-000004")
    assert startup_phases(TrainOptions(run_dir=str(run)))[-1] == ("ready", "checkpoint loaded")
    fresh = TrainOptions(run_dir=str(run), ckpt=CkptOptions(resume="none"))
    assert startup_phases(fresh)[-1][1] == "ready"
    named = TrainOptions(run_dir=str(tmp_path / "other"),
                         ckpt=CkptOptions(resume=str(run / "ckpt" / "step-000004")))
    assert startup_phases(named)[-1][1] == "checkpoint loaded"


def test_a_damaged_latest_is_not_the_views_business(tmp_path):
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest").write_text("not a step")
    assert startup_phases(TrainOptions(run_dir=str(run)))[-1][1] == "ready"


def test_the_entry_is_python_code_naming_the_worker_function():
    compile(WORKER_ENTRY, "<entry>", "exec")
    from mscale.train import worker

    assert "local_main" in WORKER_ENTRY and callable(worker.local_main)


def test_without_the_launchers_options_a_worker_says_so_in_one_line(monkeypatch, capsys):
    from mscale.train.worker import local_main

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    monkeypatch.delenv("MSCALE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        local_main([str(PLANS / "cpu-tiny.yaml")])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--local" in err and "Traceback" not in err


def test_a_plan_that_went_bad_since_the_launcher_checked_it_is_exit_3(monkeypatch, capsys,
                                                                      tmp_path):
    from mscale.train.worker import local_main

    options = TrainOptions(run_dir=str(tmp_path / "run"))
    monkeypatch.setenv(OPTIONS_ENV, options.model_dump_json())
    monkeypatch.delenv("MSCALE_DEBUG", raising=False)
    bad = tmp_path / "plan.yaml"
    bad.write_text("layout: [\n")
    with pytest.raises(SystemExit) as e:
        local_main([str(bad)])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "plan.yaml" in err and "Traceback" not in err
