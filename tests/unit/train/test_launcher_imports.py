"""The ``--local`` launchers never import torch: importing it costs ~3 s of CPU, which a launcher
that only checks its inputs and starts processes would pay before its first worker started (on
two cores that was a quarter of a 4-process start, every `mscale train --local` and
`mscale preflight --local`). Workers import it; the launchers' modules must not."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import PLANS, REPO

LAUNCHER_PATH = f"""
import sys
import mscale.cli.main
import mscale.cli.train, mscale.cli.preflight
from mscale.ckpt.options import CkptOptions
from mscale.train.options import TrainOptions
from mscale.train.launch import check_before_launch, launch_job
from mscale.train.console import layout_text
from mscale.train.job_watch import record_failure, summary_document
from mscale.runs.lock import LOCK_HELD_ENV, RunLock, next_attempt
from mscale.runs.history import check_plan_change
from mscale.preflight.options import PreflightOptions
from mscale.preflight.local import launch_local

check_before_launch({str(PLANS / "cpu-tiny.yaml")!r}, TrainOptions(run_dir=sys.argv[1]), 8)
from mscale.topology.placement import load_checked_plan
from mscale.train.off_gpu import check_fits_without_gpus
try:  # a GPU plan on a machine without GPUs: the planner's memory estimate, numpy only
    check_fits_without_gpus(load_checked_plan({str(PLANS / "gpu-1b-h200.yaml")!r}), "p", 1,
                            available=lambda: 1, visible=lambda: False)
except Exception as e:
    assert "this machine has none" in str(e), e
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", loaded[:5])
sys.exit(1 if loaded else 0)
"""


def test_the_local_launchers_do_not_import_torch(tmp_path):
    p = subprocess.run([sys.executable, "-c", LAUNCHER_PATH, str(tmp_path / "run")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
