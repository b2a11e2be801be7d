"""A restart whose data changed under it (a source re-prepared at the same path): refused
before any line says the run resumed, by the --local launcher before a worker starts and, under
srun or torchrun, by the workers before the checkpoint is loaded (train/resumed.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.e2e.test_train_faults import token_plan
from tests.e2e.train_run import MSCALE, mscale, records

pytestmark = pytest.mark.e2e

REFUSED = "/data.bin was re-prepared or changed (the same size, other contents)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_ranks(plan: str, run, *args: str) -> list[subprocess.CompletedProcess]:
    """The job's 4 ranks started as torchrun starts them (RANK, WORLD_SIZE, ...): no launcher
    checks before them, so the workers' own check is the one that answers."""
    port, procs = str(_free_port()), []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                   LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        procs.append(subprocess.Popen([MSCALE, "train", plan, "--run-dir", str(run), *args],
                                      cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.communicate()[0])
            for p in procs]


def test_a_source_changed_under_a_resume_is_refused_before_it_says_it_resumed(tmp_path):
    """The operator read "resumed from ... continuing to step 4", then the refusal. Now the
    refusal comes first, with its evidence; under torchrun rank 0 reads what the data is and
    tells the others (train/loop.py `_data_identity`), so every rank stops at once, not rank 0
    alone while its peers wait in their next collective."""
    tokens = np.random.default_rng(0).integers(0, 256, 4 * 16 * 64 + 1)
    plan = token_plan(tmp_path, "data", tokens)
    run = tmp_path / "run"
    p = mscale("train", plan, "--steps", "2", "--local", "4", "--run-dir", str(run))
    assert p.returncode == 0, p.stdout + p.stderr
    tokens[:64] = (tokens[:64] + 1) % 256  # same size: only the contents tell
    np.asarray(tokens, dtype=np.uint16).tofile(tmp_path / "data.bin")

    p = mscale("train", plan, "--steps", "4", "--local", "4", "--run-dir", str(run))
    out = p.stdout + p.stderr
    assert p.returncode == 3 and "Traceback" not in out, out
    assert REFUSED in out and "--allow-data-change" in out and plan in out, out
    assert "resumed from" not in out and "starting 4 workers" not in out, out

    t0 = time.monotonic()
    ranks = _torchrun_ranks(plan, run, "--steps", "4", "--timeout", "60")
    took = time.monotonic() - t0
    outs = "\n".join(r.stdout for r in ranks)
    assert [r.returncode for r in ranks] == [3] * 4 and "Traceback" not in outs, outs
    assert REFUSED in ranks[0].stdout and "resumed from" not in outs, outs
    assert took < 50, outs  # not a peer left to its collective timeout
    assert [m["step"] for m in records(run / "metrics.jsonl")] == [1, 2]
