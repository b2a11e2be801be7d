"""Fixtures shared by the watch tests."""

from __future__ import annotations

import shutil

import pytest

from mscale.runs.rundir import RunDir

from tests.conftest import PLANS
from tests.unit.watch.ending_runs import append_metrics, records, start


@pytest.fixture
def rd(tmp_path) -> RunDir:
    """A run directory of the cpu-tiny plan whose attempt 1 wrote 15 healthy steps."""
    run = RunDir(str(tmp_path / "run"))
    run.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", run.plan)
    start(run, 1)
    append_metrics(run, records(1, 15))
    return run
