"""A run whose ``--local 8`` attempt stopped, and the recovery stages faked as plain data, for
the tests of `plan_recovery` and `apply_plan` (test_decide*.py, test_recheck.py).

``run`` and ``fakes`` are fixtures: a module imports them by name. They live here, not in a
conftest.py, because the recover tests hold runs of several shapes, each module's own ``run``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from mscale.recover import stages
from mscale.recover.decision import CheckpointChoice, Diagnosis, Exclusions, Replan

from tests.conftest import PLANS


NODES = ["node1", "node2", "node3", "node4"]
T_FAIL = 1000.0


def write_events(run, events):
    """``events.jsonl`` of ``run`` made of ``events`` (dicts), in order."""
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture
def run(tmp_path):
    """A run directory of the cpu-tiny plan (8 ranks on node[1-4]) whose --local 8 attempt
    stopped at T_FAIL."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(PLANS / "cpu-tiny.yaml", run / "plan.yaml")
    argv = ["/venv/bin/mscale", "train", str(run / "plan.yaml"), "--run-dir", str(run),
            "--local", "8", "--steps", "20"]
    write_events(run, [
        {"kind": "start", "source": "train", "time": T_FAIL - 60, "evidence": {
            "launcher": "local", "attempt": 1, "launch": {
                "argv": argv, "cwd": str(tmp_path), "plan": str(run / "plan.yaml"), "local": 8,
                "nodes": NODES, "slurm": None}}},
        {"kind": "stop", "source": "train", "time": T_FAIL, "ranks": [5], "nodes": ["node3"]}])
    return run


class Fakes:
    """The stages as plain data; each test sets what it needs."""

    def __init__(self, run):
        self.run = run
        self.diagnosis = Diagnosis(cls="gpu", symptom="crash", summary="rank 5 on node3 died",
                                   suspect_ranks=[5], suspect_nodes=["node3"], failed_step=12,
                                   attempt=1)
        self.choice = CheckpointChoice(path=str(run / "ckpt/step-000010"), step=10,
                                       reason="newest that verifies")
        self.exclusions = Exclusions()
        self.replan = None
        self.skip = None
        self.rechecked = None
        self.calls = []

    def install(self, monkeypatch):
        def exclusions(run, diagnosis, recheck=None, plan=None, ran=None, kept=None):
            if recheck is not None:
                self.rechecked = recheck(diagnosis.suspect_nodes)
            return self.exclusions

        def replan(run, plan, exclusions, *, ran=None, allow_batch_change=False, write=True):
            self.calls.append(("replan", write, allow_batch_change))
            if isinstance(self.replan, Exception):
                raise self.replan
            return self.replan

        monkeypatch.setattr(stages, "diagnose", lambda run_dir: self.diagnosis)
        monkeypatch.setattr(stages, "choose_checkpoint", lambda run, d, verify="quick":
                            self.choice)
        monkeypatch.setattr(stages, "decide_exclusions", exclusions)
        monkeypatch.setattr(stages, "replan", replan)
        monkeypatch.setattr(stages, "data_skip_for", lambda d, c, skips=None: self.skip)
        monkeypatch.setattr(stages, "record_data_skip",
                            lambda run, skip: self.calls.append(("skip", skip.skip_steps)))
        monkeypatch.setattr(stages, "pin_checkpoint",
                            lambda run, path, reason: self.calls.append(("pin", path)))
        return self


@pytest.fixture
def fakes(run, monkeypatch):
    return Fakes(run).install(monkeypatch)


def shrunk(run) -> Replan:
    return Replan(plan_path=str(run / "recover/plan-0001.yaml"), nodes=["node1", "node2"],
                  world=4, layout="tp2 pp2 dp1 on 2 nodes (cpu-4x2)",
                  old_layout="tp2 pp2 dp2 on 4 nodes (cpu-4x2)", old_step_time_s=1.0,
                  new_step_time_s=1.8, global_batch=16, unused_nodes=["node4"],
                  note="DP 2 -> 1, 2x more micro-batches")


def srun_command(run, exclude: str) -> list[str]:
    """supervise's CMD inside an allocation, with the operator's own srun -x (``run``: a path)."""
    return ["srun", "-x", exclude, "-N4", "-n8", "/venv/bin/mscale", "train",
            str(run / "plan.yaml"), "--run-dir", str(run)]
