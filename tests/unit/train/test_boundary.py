"""The step boundary (`boundary.at_boundary`), on one process: what it decides from the
operator's requests, rank 0's trouble and the checkpointer, and that rank 0 reads lock.json
before any save it starts, interval or requested."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from mscale.errors import EXIT_BAD_INPUT, EXIT_WARNING
from mscale.runs.rundir import RunDir
from mscale.train.control import Control
from mscale.train import waiting
from mscale.train.boundary import Boundary, at_boundary, lock_before_requested_save
from mscale.train.session import Journal, RunSession


class Saves:
    """The checkpointer's side of a boundary: `due` as `Checkpointer.due` decides it, and the
    saves started."""

    def __init__(self, interval: int):
        self.interval, self.started, self.fatal = interval, [], None
        self.inflight = None  # the save still being written (`Checkpointer.inflight`)
        self.write_s = 0.0  # how long `save` waits for it

    def poll(self) -> None:
        pass

    def due(self, step: int, requested: bool = False, final: bool = False) -> str | None:
        if requested:
            return "request"
        return "interval" if step % self.interval == 0 else None

    def save(self, step: int, reason: str, lr: float | None = None) -> None:
        time.sleep(self.write_s)
        self.started.append((step, reason))


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Rank 0 of job-a, holding its run's lock; its control directory; its saves."""
    from mscale.runs.lock import LOCK_HELD_ENV, RunLock

    monkeypatch.delenv(LOCK_HELD_ENV, raising=False)
    run = RunDir(str(tmp_path / "run"))
    run.create()
    s = RunSession(run, Journal(run, enabled=True), "job-a")
    s.lock = RunLock(run.root, "job-a").acquire()
    s.token = s.lock.record.token
    engine = SimpleNamespace(plan=SimpleNamespace(training=SimpleNamespace(steps=100)),
                             env=SimpleNamespace(rank=0),
                             options=SimpleNamespace(json_summary=False))
    control_dir = tmp_path / "run" / "control"
    control_dir.mkdir(exist_ok=True)
    yield SimpleNamespace(run=run, s=s, engine=engine, control_dir=control_dir,
                          control=Control(str(control_dir), 0), saves=Saves(interval=10))
    s.lock.release()


def _boundary(job, step: int):
    return at_boundary(job.engine, job.s, job.saves, job.control, step, lr=1e-3)


def _take_over(job) -> None:
    """Another job takes the run over: job-a's lease ran out while it was stopped."""
    from mscale.runs.lock import RunLock

    later = time.time() + 3600
    RunLock(job.run.root, "job-b", clock=lambda: later).acquire()


def test_a_plain_step_goes_on_and_an_interval_step_saves(job):
    assert _boundary(job, 4) == Boundary()  # nothing due, nothing asked
    after = _boundary(job, 9)  # step 10 done
    assert after.stop is None and after.saving and job.saves.started == [(10, "interval")]


def test_a_requested_save_starts_and_a_halt_stops_after_it(job):
    (job.control_dir / "checkpoint").touch()
    after = _boundary(job, 4)
    assert after.stop is None and after.saving and job.saves.started == [(5, "request")]
    (job.control_dir / "halt").mkdir()
    after = _boundary(job, 5)
    assert after.stop[0] == EXIT_WARNING and after.stop[1][:2] == ("halt", 6)
    assert job.saves.started[-1] == (6, "request")


def test_a_requested_save_after_a_takeover_stops_without_saving(job):
    """No interval save is due at step 5, so the trouble check did not read the lock: the
    request's save must read it before any shard file is opened."""
    _take_over(job)
    (job.control_dir / "checkpoint").touch()
    after = _boundary(job, 4)
    assert after.stop[0] == EXIT_BAD_INPUT and after.stop[1][:2] == ("abort", 5)
    assert after.stop[1][2].startswith("run lock taken over by run job-b")
    assert job.saves.started == []


def test_an_interval_save_after_a_takeover_stops_without_saving(job):
    _take_over(job)
    assert _boundary(job, 4).stop is None  # no save due: the heartbeat's to notice
    after = _boundary(job, 9)
    assert after.stop[0] == EXIT_BAD_INPUT and "run lock taken over" in after.stop[1][2]
    assert job.saves.started == []


def test_a_halt_that_waits_for_a_slow_save_says_so_while_it_waits(job, monkeypatch, capsys):
    """A save still being written holds the halt's own save: the console says so every
    `waiting.NOTICE_EVERY_S` (10 s) instead of staying silent until the commit, minutes on a
    slow filesystem, while an operator wonders whether to press Ctrl-C again."""
    monkeypatch.setattr(waiting, "NOTICE_EVERY_S", 0.05)
    job.saves.inflight = SimpleNamespace(name="step-000003")
    job.saves.write_s = 0.3
    (job.control_dir / "halt").touch()
    after = _boundary(job, 5)
    assert after.stop is not None and job.saves.started == [(6, "request")]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2, lines
    assert re.fullmatch(r"checkpoint step-000003 still being written after \d+ s; the save of "
                        r"step 6 before the stop waits for it", lines[0]), lines
    job.saves.inflight, job.saves.started = None, []  # nothing in flight: nothing said
    (job.control_dir / "halt").touch()
    _boundary(job, 6)
    assert capsys.readouterr().out == ""


def test_a_requested_save_reads_the_lock_first(tmp_path, monkeypatch):
    """A save that a signal or control file starts at a boundary with no interval save due is
    preceded by rank 0's read of lock.json, agreed by every rank: a job woken past its lease by
    SIGTERM stops without opening a shard file."""
    from mscale.runs.lock import LOCK_HELD_ENV, RunLock

    run = RunDir(str(tmp_path / "run"))
    monkeypatch.delenv(LOCK_HELD_ENV, raising=False)
    s = RunSession(run, Journal(run, enabled=True), "job-a")
    s.lock = RunLock(run.root, "job-a").acquire()
    s.token = s.lock.record.token
    control = Control(None, 0)
    assert lock_before_requested_save(s, control, rank=0) is None
    later = time.time() + 3600
    RunLock(run.root, "job-b", clock=lambda: later).acquire()
    assert lock_before_requested_save(s, control, rank=0).startswith(
        "run lock taken over by run job-b")
    monkeypatch.setattr(Control, "agree", staticmethod(lambda flag, group=None: True))
    assert lock_before_requested_save(s, control, rank=1).startswith(  # told by rank 0
        "rank 0 could not go on")
