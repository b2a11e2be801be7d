"""End-to-end fixtures. `slurm`: a real four-node SLURM (node[1-4]) on this machine.

The cluster comes from scripts/slurm-local.sh (apt-installs slurm-wlm and munge when missing), so
it needs root and apt-get. Without them the SLURM tests skip, except in CI (CI=true), where CI runs
as root with apt and a SLURM that does not come up must fail the suite, not vanish from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import pytest

from tests.conftest import REPO, in_ci

SCRIPT = REPO / "scripts" / "slurm-local.sh"
JOB_NAME = "mscale-e2e"
"""Every job the tests submit carries this name, so teardown can cancel a job a timeout left."""

# Launcher variables that must not leak from the caller into tasks: srun passes its whole
# environment on, and read_launch_env prefers torchrun's RANK/WORLD_SIZE over SLURM's.
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
          "MASTER_ADDR", "MASTER_PORT", "MSCALE_LAUNCHER", "TORCHELASTIC_RESTART_COUNT")


@dataclass
class Slurm:
    """Runs SLURM client commands from the repository root with a clean launcher environment."""

    python: str = sys.executable

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in _SCRUB and not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**env, **extra}

    def run(self, *args: str, timeout: float = 120, **extra_env: str) -> str:
        """Run a command; its stdout. A hang fails in ``timeout`` s instead of stalling CI."""
        p = subprocess.run(list(args), cwd=REPO, env=self.env(**extra_env), text=True,
                           capture_output=True, timeout=timeout)
        assert p.returncode == 0, f"{' '.join(args)} → {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p.stdout


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"SLURM is required in CI (CI={os.environ['CI']}): {reason}", pytrace=False)
    pytest.skip(reason)


def _stop() -> None:
    subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def _cancel_our_jobs(wait_s: float = 60) -> None:
    """Cancel every job the tests submitted and wait until SLURM has let go of their nodes.

    A test that times out kills its ``srun``/``sbatch --wait`` but not the job: a pending or
    running job left behind would hold the nodes and make every later SLURM test wait too."""
    subprocess.run(["scancel", "--name", JOB_NAME], capture_output=True, timeout=30)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        left = subprocess.run(["squeue", "-h", "--name", JOB_NAME, "-o", "%i"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        if not left:
            return
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "slurm" in request.fixturenames:
        _cancel_our_jobs()


@pytest.fixture(scope="session")
def slurm() -> Iterator[Slurm]:
    """Bring the local SLURM up once per session; stop it at the end if this session started it."""
    if os.geteuid() != 0:
        _unavailable("local SLURM needs root (scripts/slurm-local.sh installs and runs daemons)")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        _unavailable("local SLURM needs apt-get to install slurm-wlm and munge")
    try:
        p = subprocess.run(["bash", str(SCRIPT), "start"], text=True, capture_output=True,
                           timeout=240)
    except subprocess.TimeoutExpired:
        _stop()
        _unavailable("scripts/slurm-local.sh start took over 240 s")
    if p.returncode:
        _stop()  # whatever half of the cluster did come up
        _unavailable(f"scripts/slurm-local.sh start failed ({p.returncode}):\n"
                     f"{p.stdout}{p.stderr}")
    # Leave a cluster someone else had running as we found it.
    started = "already running" not in p.stdout
    try:
        yield Slurm()
    finally:
        _cancel_our_jobs()
        if started:
            _stop()
