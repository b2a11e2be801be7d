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


@pytest.mark.parametrize("words, env, waits", [
    (["sbatch", "-N", "4", "--wait", "job.sh"], {}, True),
    (["sbatch", "-W", "job.sh"], {}, True),
    (["sbatch", "job.sh", "--wait"], {}, False),  # the script's own argument
    (["sbatch", "job.sh"], {"SBATCH_WAIT": "1"}, True),
    (["sbatch", "-x", "/etc/hosts", "--wait", "job.sh"], {}, True),  # a value, not the script
    (["sbatch", "--wrap", "srun --wait=0 true"], {}, False),
])
def test_what_counts_as_an_sbatch_that_waits(monkeypatch, words, env, waits):
    from mscale.cli.recover_supervise import _sbatch_waits

    monkeypatch.delenv("SBATCH_WAIT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _sbatch_waits(words) is waits
