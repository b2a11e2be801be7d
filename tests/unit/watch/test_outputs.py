"""watch/outputs.py: what the operator reads under a finding and after an action."""

from __future__ import annotations

import shlex

from mscale.runs.rundir import RunDir
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.outputs import action_text, halt_command

from tests.unit.watch.test_actions import Clock, straggler


def quarantine_line(run: RunDir, job_alive: bool) -> str:
    clock = Clock(1000.0)
    a = Actor(run, ActionConfig(), clock=clock)
    a.handle([straggler()], job_alive=job_alive)
    if job_alive:  # the job commits the requested checkpoint; then the node goes out
        clock.t = 1010.0
        a.observe([{"source": "train", "kind": "checkpoint", "time": 1008.0, "step": 16}])
    [entry] = [x for x in a.log if x["action"] == "quarantine"]
    return action_text(entry, run.root)


def test_a_live_quarantine_says_how_to_stop_the_job_quoted_for_a_shell(tmp_path):
    """The node is out of the pool, but the job runs on with it: the line gave the relaunch for
    after the stop and not how to stop it (found in a user trial)."""
    run = RunDir(str(tmp_path / "my run"))
    run.create()
    line = quarantine_line(run, job_alive=True)
    halt = shlex.quote(f"{run.root}/control/halt")
    assert line.startswith("node2 quarantined after the requested checkpoint was committed")
    assert f"to stop it now (a checkpoint is saved first): touch {halt};" in line
    assert f"mscale recover {shlex.quote(run.root)} --execute" in line
    # a job that is not running has nothing to stop
    assert "control/halt" not in quarantine_line(run, job_alive=False)


def test_the_halt_command_of_a_remote_run_is_no_touch():
    assert halt_command("file:///runs/r1/") == "touch /runs/r1/control/halt"
    assert halt_command("s3://bucket/runs/r1") == (
        "write an empty object at s3://bucket/runs/r1/control/halt")
