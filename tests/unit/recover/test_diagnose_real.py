"""diagnose() on run directories that real `mscale train --local 4` jobs left: a NaN, a rank
killed with SIGKILL then a resumed attempt that finished, a rank stopped with SIGSTOP.

The faults come from train's hidden test hooks (train/faults.py): the rank kills or stops itself
mid-step at a given step, so the test waits on nothing but the job's exit."""

from __future__ import annotations

from pathlib import Path

import pytest

from mscale.recover.diagnose import diagnose
from tests.e2e.train_run import mscale, small_plan

pytestmark = pytest.mark.e2e


def train(tmp_path: Path, run: Path, *args: str, code: int):
    done = mscale("train", small_plan(tmp_path), "--local", "4", "--run-dir", str(run), *args)
    assert done.returncode == code, done.stdout + done.stderr


def test_a_real_nan(tmp_path):
    run = tmp_path / "run"
    train(tmp_path, run, "--steps", "6", "--inject-nan", "3", code=2)
    d = diagnose(str(run))
    assert (d.cls, d.symptom, d.bad_step, d.failed_step, d.exit_code) == \
        ("numerics", "nan", 3, 2, 2)


def test_a_real_kill_then_a_resumed_attempt(tmp_path):
    run = tmp_path / "run"
    train(tmp_path, run, "--steps", "6", "--ckpt-interval", "2", "--inject-crash", "2:4", code=3)
    d = diagnose(str(run))
    assert (d.cls, d.symptom, d.attempt, d.exit_code) == ("unknown", "signal", 1, 3), d
    assert d.suspect_ranks == [2] and d.suspect_nodes == ["node2"]
    train(tmp_path, run, "--steps", "6", "--inject-crash", "2:4", code=0)  # attempt 2: disarmed
    d = diagnose(str(run))  # the first attempt's error files are still on disk
    assert (d.cls, d.symptom, d.attempt, d.failed_step) == ("none", "finished", 2, 6)


def test_a_real_sigstop_names_the_stopped_rank(tmp_path):
    run = tmp_path / "run"
    train(tmp_path, run, "--steps", "6", "--timeout", "4", "--inject-hang", "1:3", code=3)
    d = diagnose(str(run))
    assert (d.symptom, d.suspect_ranks, d.suspect_nodes) == ("hang", [1], ["node1"]), d
    assert all(e.rank != 1 for e in d.evidence if e.source.endswith("error.json"))
