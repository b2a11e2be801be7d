"""``mscale recover supervise`` command line: what it refuses before it launches anything."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("sbatch", ["sbatch", "/usr/bin/sbatch"])
def test_sbatch_without_wait_is_refused_not_read_as_finished(cli, tmp_path, sbatch):
    """sbatch returns 0 once the job is queued: supervise said "the job finished (exit 0)"
    while the job sat pending, and never recovered it."""
    run = tmp_path / "run"
    code, out, err = cli("recover", "supervise", "--run-dir", str(run), "--",
                         sbatch, "--nodes=4", "job.sh")
    assert code == 3 and "sbatch without --wait" in out + err and "finished" not in out + err
    assert not (run / "recover").exists()  # refused before anything is written
