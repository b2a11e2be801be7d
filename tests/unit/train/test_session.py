"""Rank 0's journal: what the run directory's filesystem refuses stops the job with one line;
what the code gets wrong still raises."""

from __future__ import annotations

import errno

import pytest

from mscale.config.records import Event
from mscale.runs.rundir import RunDir
from mscale.train.session import Journal, RunSession


def _journal(tmp_path, monkeypatch, exc: Exception) -> Journal:
    run = RunDir(str(tmp_path))
    run.create()

    def refuse(self, url, record):
        raise exc

    monkeypatch.setattr(RunDir, "append_record", refuse)
    return Journal(run, enabled=True)


@pytest.mark.parametrize("code, fix", [
    (errno.ENOSPC, "free space, then resume"),
    (errno.EROFS, "make the run directory's filesystem writable again, then resume"),
    (errno.EACCES, "make the run directory's filesystem writable again, then resume"),
    (errno.EIO, "make the run directory's filesystem writable again, then resume"),
])
def test_a_filesystem_that_refuses_an_append_stops_the_job_with_the_fix(tmp_path, monkeypatch,
                                                                          code, fix):
    journal = _journal(tmp_path, monkeypatch, OSError(code, "refused", "metrics.jsonl"))
    event = Event(source="train", kind="info", message="m")
    journal.append(journal.run.events, event)
    journal.append(journal.run.events, event)  # held back from now on: no second raise
    assert journal.failure.errno == code
    why = RunSession(journal.run, journal, "r").trouble()
    assert why.startswith(f"[Errno {code}] refused") and why.endswith(
        f"this stop saves no checkpoint; {fix}")


def test_an_error_of_the_code_is_not_held_back(tmp_path, monkeypatch):
    journal = _journal(tmp_path, monkeypatch, TypeError("not a record"))
    with pytest.raises(TypeError):
        journal.append(journal.run.events, Event(source="train", kind="info", message="m"))
    assert journal.failure is None


def test_lock_lost_reads_the_lock_the_job_runs_under(tmp_path, monkeypatch):
    """What rank 0's checkpointer asks before each commit: its own lock (by token), or under a
    --local launcher the launcher's (by the run id the launcher passes in LOCK_HELD_ENV)."""
    import time

    from mscale.runs.lock import LOCK_HELD_ENV, RunLock

    run = RunDir(str(tmp_path / "run"))
    later = time.time() + 3600  # every lock here is past its lease for a taker with this clock
    monkeypatch.delenv(LOCK_HELD_ENV, raising=False)
    own = RunSession(run, Journal(run, enabled=True), "job-a")
    own.lock = RunLock(run.root, "job-a").acquire()
    own.token = own.lock.record.token
    assert own.lock_lost() is None
    RunLock(run.root, "job-b", clock=lambda: later).acquire()
    assert own.lock_lost().startswith("run lock taken over by run job-b")
    monkeypatch.setenv(LOCK_HELD_ENV, "local-x")
    launched = RunSession(run, Journal(run, enabled=True), "local-x")
    RunLock(run.root, "local-x", clock=lambda: later + 3600).acquire()  # the launcher's
    assert launched.lock_lost() is None
    RunLock(run.root, "job-c", clock=lambda: later + 7200).acquire()
    assert launched.lock_lost().startswith("run lock taken over by run job-c")


def test_trouble_reads_the_lock_when_a_save_starts(tmp_path, monkeypatch):
    """A job woken past its lease must not start a save (every rank would truncate the shard
    files of a step the new owner may have committed): rank 0 reads lock.json at a boundary
    where a save is due, before its heartbeat has run; an unreadable lock stops nothing."""
    import time

    from mscale.runs.lock import LOCK_HELD_ENV, RunLock

    run = RunDir(str(tmp_path / "run"))
    monkeypatch.delenv(LOCK_HELD_ENV, raising=False)
    s = RunSession(run, Journal(run, enabled=True), "job-a")
    s.lock = RunLock(run.root, "job-a").acquire()
    s.token = s.lock.record.token
    assert s.trouble(save_due=True) is None
    later = time.time() + 3600
    RunLock(run.root, "job-b", clock=lambda: later).acquire()
    assert s.trouble() is None  # no save: the heartbeat's to notice
    assert s.trouble(save_due=True).startswith("run lock taken over by run job-b")
    monkeypatch.setattr(RunSession, "lock_lost", lambda self: 1 / 0)
    assert s.trouble(save_due=True) is None


def test_a_changed_plan_becomes_the_runs_only_when_the_start_goes_ahead(tmp_path, monkeypatch):
    """`--steps 4` on a run at step 10 trains nothing: its plan must not replace the run's, or
    the next start reports the run's own plan as a change (training.steps, warmup_steps)."""
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.runs.history import plan_history
    from mscale.runs.lock import LOCK_HELD_ENV
    from tests.unit.runs.test_history import _plan, trained

    monkeypatch.setenv(LOCK_HELD_ENV, "r")  # the launcher's lock: none taken here
    run = RunDir(str(tmp_path / "run"))
    first, shorter = _plan(), _plan(training={"steps": 4, "warmup_steps": 2})
    assert RunSession(run, Journal(run, True), "r").claim(first).kind == "new"
    assert load_model(Plan, run.plan) == first  # a new run directory records its plan at once
    trained(run)  # the run at step 10
    session = RunSession(run, Journal(run, True), "r")
    change = session.claim(shorter)
    assert change.kind == "changed" and "training.steps" in change.fields
    assert load_model(Plan, run.plan) == first and len(plan_history(run)) == 1
    assert session.write_changed_plan().endswith("plans/plan-0002.yaml")
    assert load_model(Plan, run.plan) == shorter
    assert session.write_changed_plan() is None  # written once


def test_a_plan_on_other_nodes_is_the_runs_from_the_claim(tmp_path, monkeypatch):
    """recover reads plan.yaml as the plan the failed attempt ran: a start on its smaller plan
    that fails before a step trains (build, resume) must leave that plan, not the old one whose
    nodes (node3, node4) the recovery kept out and would put back."""
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.runs.lock import LOCK_HELD_ENV
    from tests.unit.runs.test_history import _plan, trained

    monkeypatch.setenv(LOCK_HELD_ENV, "r")
    run = RunDir(str(tmp_path / "run"))
    first = _plan()
    smaller = _plan(layout={"dp": 1}, cluster={"nodes": 2, "hostlist": "node[1-2]"})
    RunSession(run, Journal(run, True), "r").claim(first)
    trained(run)  # attempt 1 trained, then failed on node3
    session = RunSession(run, Journal(run, True), "r")
    change = session.claim(smaller)
    assert change.relayout and change.history.endswith("plans/plan-0002.yaml")
    assert load_model(Plan, run.plan) == smaller
    assert session.write_changed_plan() is None  # nothing left to write once a step trains


def test_a_fixed_plan_replaces_one_that_never_trained_at_the_claim(tmp_path, monkeypatch):
    """The first start failed before step 1 (a data path found wrong on the nodes): its plan
    must not pin the run. The fixed plan is accepted and is plan.yaml from the claim, as recover
    reads plan.yaml as the plan the failed attempt ran."""
    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.runs.lock import LOCK_HELD_ENV
    from tests.unit.runs.test_history import _plan

    monkeypatch.setenv(LOCK_HELD_ENV, "r")
    run = RunDir(str(tmp_path / "run"))
    bad = _plan(training={**_plan().training.model_dump(mode="json", exclude_none=True),
                          "data": {"kind": "tokens", "path": "/nowhere/tokens"}})
    RunSession(run, Journal(run, True), "r").claim(bad)
    session = RunSession(run, Journal(run, True), "r")
    change = session.claim(_plan())
    assert change.untrained and change.history.endswith("plans/plan-0002.yaml")
    assert load_model(Plan, run.plan) == _plan()
    assert session.write_changed_plan() is None
