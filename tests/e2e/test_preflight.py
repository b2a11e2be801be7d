"""`mscale preflight` as users run it: the real binary on 8 gloo processes (tp2 pp2 dp2 on four
2-process nodes), and under a real four-node SLURM.

A rank is slowed by the hidden ``--inject-slow RANK:FACTOR`` hook: that rank's timed GEMM
iterations, point-to-point round trips and collectives take FACTOR times as long in wall time
(it sleeps (FACTOR − 1) × the operation's fastest time inside the timed region), so its peers wait for
it exactly as they would for a slow device.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import PLANS, REPO
from tests.e2e.conftest import JOB_NAME
from tests.e2e.train_run import HANG_GUARD_S, MSCALE, mscale

pytestmark = [pytest.mark.e2e, pytest.mark.timing]

PLAN = str(PLANS / "cpu-tiny.yaml")


def _report(p: subprocess.CompletedProcess) -> dict:
    assert p.stdout.strip(), p.stderr
    return json.loads(p.stdout)


def _critical(report: dict) -> list[dict]:
    return [r for r in report["results"] if r["status"] == "CRITICAL"]


def test_a_slowed_rank_is_flagged_and_only_its_node_is_excluded(tmp_path):
    run = tmp_path / "run"
    p = mscale("preflight", PLAN, "--run-dir", str(run), "--local", "8", "--json",
               "--inject-slow", "5:6", "--prometheus", str(tmp_path / "pf.prom"))
    assert p.returncode == 2, p.stdout + p.stderr
    report = _report(p)
    assert report["bad_nodes"] == ["node3"] and report["exclude"] == "node3"
    gemm = {r["entity"]: r for r in report["results"] if r["check"] == "gemm"}
    assert gemm["rank 5"]["status"] == "CRITICAL" and gemm["rank 5"]["node"] == "node3"
    assert all(r["status"] == "OK" for e, r in gemm.items() if e != "rank 5")
    assert {r["node"] for r in _critical(report)} <= {"node3", None}
    assert json.loads((run / "preflight.json").read_text())["exclude"] == "node3"
    assert 'check="gemm",entity="rank 5",node="node3"} 2' in (tmp_path / "pf.prom").read_text()
    # every file written is named, on stderr (stdout is the --json document alone)
    assert f"wrote preflight report: {run / 'preflight.json'}" in p.stderr, p.stderr
    assert f"wrote Prometheus textfile: {tmp_path / 'pf.prom'}" in p.stderr, p.stderr
    # the workers' logs are in the run directory, in their own folder of logs/ (not a /tmp
    # directory left behind; not over a training attempt's logs/rank<N>.log)
    logs = run / "logs" / "preflight"
    assert f"worker logs in {logs}\n" in p.stderr, p.stderr
    assert [x.name for x in (run / "logs").iterdir()] == ["preflight"]
    assert {f"rank{r}.{kind}" for r in range(8) for kind in ("log", "startup", "pid")} == \
        {x.name for x in logs.iterdir()}
    assert "preflight [1/5]" in (logs / "rank0.log").read_text()  # rank 0's lines, teed


def test_a_healthy_job_flags_nothing_run_after_run(tmp_path):
    for i in range(2):
        p = mscale("preflight", PLAN, "--run-dir", str(tmp_path / f"run{i}"), "--local", "8",
                   "--json")
        report = _report(p)
        flagged = [r for r in report["results"] if r["status"] != "OK"]
        assert p.returncode == 0 and not flagged and report["exclude"] == "", flagged
        m = report["measured"]
        assert m["gemm_tflops"]["median"] > 0 and set(m["busbw_gbps"]) == {"tp", "pp", "dp"}


def test_a_world_size_the_plan_does_not_have_is_bad_input_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    p = mscale("preflight", PLAN, "--run-dir", str(run), "--local", "4")
    assert p.returncode == 3 and "needs 8 processes" in p.stderr and not run.exists()
    env = dict(os.environ, RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999")
    p = subprocess.run([MSCALE, "preflight", PLAN, "--run-dir", str(run)], cwd=REPO, env=env, text=True,
                       capture_output=True, timeout=60)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "started 4 processes" in p.stderr and "Traceback" not in p.stderr
    assert not run.exists()


@pytest.mark.slurm
def test_srun_names_the_slowed_node_alone_and_sbatch_accepts_the_exclude_list(slurm, tmp_path):
    run = tmp_path / "run"
    exe = os.path.join(os.path.dirname(slurm.python), "mscale")
    p = subprocess.run(["srun", "-J", JOB_NAME, "-N", "4", "-n", "8", "--ntasks-per-node=2", exe,
                        "preflight", PLAN, "--run-dir", str(run), "--timeout", "60",
                        "--inject-slow", "4:4", "--inject-slow", "5:4"], cwd=REPO,
                       env=slurm.env(MASTER_ADDR="127.0.0.1"), text=True, capture_output=True,
                       timeout=240)
    assert p.returncode == 2, p.stdout + p.stderr
    report = json.loads((run / "preflight.json").read_text())
    slowed_node = report["bad_nodes"]
    assert slowed_node == ["node3"] and report["exclude"] == "node3"  # ranks 4, 5 run there
    assert f"sbatch --exclude={report['exclude']}" in p.stdout
    out = slurm.run("sbatch", "--wait", "--parsable", "-J", JOB_NAME, "-N", "3",
                    f"--exclude={report['exclude']}", "-o", str(tmp_path / "job.out"),
                    "--wrap", "srun sh -c 'echo $SLURMD_NODENAME'")
    hosts = set((tmp_path / "job.out").read_text().split())
    assert out.strip() and len(hosts) == 3 and slowed_node[0] not in hosts


def test_a_hung_rank_is_named_by_its_node_within_the_timeout(tmp_path):
    # rank 5 sleeps far past --timeout inside its first timed GEMM: its peers' barrier times
    # out, rank 0 names the rank that neither finished the phase nor saw it fail
    # (a job that ignored --timeout would wait gloo's 30 minutes and fail HANG_GUARD_S)
    run = tmp_path / "run"
    p = mscale("preflight", PLAN, "--run-dir", str(run), "--local", "8", "--json",
               "--timeout", "3", "--inject-slow", "5:20000", timeout=HANG_GUARD_S)
    assert p.returncode == 2, p.stdout + p.stderr
    report = _report(p)
    assert [(r["check"], r["entity"], r["node"]) for r in _critical(report)] == [
        ("rank_alive", "rank 5", "node3")]
    assert report["exclude"] == "node3"
    # what was measured before the stop stays, and what was not is said, blamed on no node
    assert {r["entity"] for r in report["results"] if r["check"] == "clock_skew"} == {
        f"node{n}" for n in range(1, 5)}
    stopped = [r for r in report["results"] if r["check"] == "stopped"]
    assert [(r["entity"], r["ranks"], r["node"], r["status"]) for r in stopped] == [
        ("phase compute", [0, 1, 2, 3, 4, 6, 7], None, "UNKNOWN")], stopped
