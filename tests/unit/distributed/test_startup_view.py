"""Start-up progress of ``--local`` workers (distributed/startup.py): the phase markers each worker
appends, how the launcher reads them, and what the console shows on a terminal and elsewhere.
No processes and no waiting: the clock is injected."""

from __future__ import annotations

import io

from mscale.distributed.watcher import watch_workers
from mscale.distributed.startup import (PHASE_FILE_ENV, StartupView, mark_phase, phase_file,
                                        progress_text, reached, read_phases)

PHASES = [("imported", "imported"), ("rendezvous", "rendezvous"), ("built", "model built"),
          ("ready", "ready")]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def view_of(marks: dict[int, list[str]], stream, clock, nprocs=4, **kw) -> StartupView:
    read = lambda r: [(m, 0.0) for m in marks.get(r, [])]  # noqa: E731
    kw.setdefault("width", 200)
    return StartupView(nprocs, PHASES, stream, read, clock=clock, tick_s=0.5, plain_every_s=4.0,
                       **kw)


def test_a_worker_appends_markers_that_the_launcher_reads(tmp_path):
    path = phase_file(str(tmp_path), 3)
    assert path.endswith("rank3.startup")
    env = {PHASE_FILE_ENV: path}
    mark_phase("imported", env)
    mark_phase("rendezvous", env)
    assert [name for name, _ in read_phases(path)] == ["imported", "rendezvous"]
    assert all(t > 0 for _, t in read_phases(path))


def test_marking_without_a_launcher_or_with_a_bad_path_does_nothing(tmp_path):
    mark_phase("imported", {})  # torchrun / srun: no file named
    mark_phase("imported", {PHASE_FILE_ENV: str(tmp_path / "missing-dir" / "rank0.startup")})
    assert list(tmp_path.iterdir()) == []


def test_a_line_still_being_written_and_garbage_are_left_out(tmp_path):
    path = tmp_path / "rank0.startup"
    path.write_text("spawned 1.5\nimported 2.0\nnonsense\nrendezvous 3")
    assert read_phases(str(path)) == [("spawned", 1.5), ("imported", 2.0)]
    assert read_phases(str(tmp_path / "absent")) == []


def test_the_furthest_phase_counts_even_if_an_earlier_marker_is_missing():
    order = [m for m, _ in PHASES]
    assert reached([], order) == 0
    assert reached([("spawned", 1.0)], order) == 0
    assert reached([("imported", 1.0), ("built", 2.0)], order) == 3


def test_the_text_counts_workers_per_phase():
    text = progress_text([4, 2, 0], ["imported", "rendezvous", "model built"], 4, 12.4)
    assert text == "starting 4 workers (12 s): imported 4/4, rendezvous 2/4, model built 0/4"
    one = progress_text([0, 0, 0], ["imported", "rendezvous", "model built"], 1, 3.0)
    assert one.startswith("starting 1 worker (3 s): ")  # said "1 workers" under --local 1


def test_not_a_terminal_a_plain_line_only_after_the_interval():
    out, clock, marks = io.StringIO(), Clock(), {0: ["imported"], 1: ["imported", "rendezvous"]}
    view = view_of(marks, out, clock, tty=False)
    view.poll()
    assert out.getvalue() == ""  # the launcher's own line was just written
    clock.t += 4.0
    view.poll()
    assert out.getvalue() == ("starting 4 workers (4 s): imported 2/4, rendezvous 1/4, "
                              "model built 0/4, ready 0/4\n")
    clock.t += 2.0
    view.poll()
    assert out.getvalue().count("\n") == 1
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_not_a_terminal_rank0s_lines_reset_the_interval():
    out, clock = io.StringIO(), Clock()
    view = view_of({}, out, clock, tty=False)
    clock.t += 3.0
    view.line("preflight [1/5] building groups\n")
    clock.t += 3.0
    view.poll()  # 6 s since the start, 3 s since the last line: nothing to add
    assert out.getvalue() == "preflight [1/5] building groups\n"
    clock.t += 1.0
    view.poll()
    assert out.getvalue().endswith("ready 0/4\n")


def test_on_a_terminal_one_line_is_redrawn_and_cleared_for_rank0s_output():
    out, clock, marks = Tty(), Clock(), {0: ["imported"]}
    view = view_of(marks, out, clock)
    assert view.tty
    view.poll()
    assert out.getvalue() == ("\rstarting 4 workers (0 s): imported 1/4, rendezvous 0/4, "
                              "model built 0/4, ready 0/4\x1b[K")
    clock.t += 0.2
    view.poll()  # within tick_s: not even read
    marks[1] = ["imported"]
    clock.t += 0.4
    view.poll()
    assert out.getvalue().endswith("imported 2/4, rendezvous 0/4, model built 0/4, ready 0/4"
                                   "\x1b[K")
    before = len(out.getvalue())
    view.line("a line of rank 0\n")
    assert out.getvalue()[before:] == "\r\x1b[Ka line of rank 0\n"
    clock.t += 0.5
    view.poll()
    assert out.getvalue().endswith("\x1b[K") and out.getvalue().count("\rstarting") == 3


def test_the_view_ends_when_every_worker_is_ready_and_erases_its_line():
    out, clock = Tty(), Clock()
    marks = {r: ["imported"] for r in range(4)}
    view = view_of(marks, out, clock)
    view.poll()
    for r in range(4):
        marks[r] = ["imported", "rendezvous", "built", "ready"]
    clock.t += 1.0
    view.poll()
    assert view.done and out.getvalue().endswith("\r\x1b[K")
    size = len(out.getvalue())
    clock.t += 10.0
    view.poll()
    view.line("step 1/3\n")
    assert out.getvalue()[size:] == "step 1/3\n"


def test_close_erases_the_line_and_nothing_follows():
    out, clock = Tty(), Clock()
    view = view_of({}, out, clock)
    view.poll()
    view.close()
    assert out.getvalue().endswith("\r\x1b[K")
    size = len(out.getvalue())
    clock.t += 10.0
    view.poll()
    assert len(out.getvalue()) == size


def test_a_stream_that_is_not_a_terminal_is_detected():
    view = StartupView(2, PHASES, io.StringIO(), lambda r: [])
    assert not view.tty


class _Proc:
    def __init__(self, codes: list[int | None]):
        self.codes, self.pid = codes, 0
        self.signals: list[int] = []

    def poll(self):
        return self.codes[0] if len(self.codes) == 1 else self.codes.pop(0)

    def send_signal(self, s):
        self.signals.append(s)

    def kill(self):
        self.signals.append(9)


def test_the_watcher_calls_the_progress_hook_and_survives_its_errors(monkeypatch):
    monkeypatch.setattr("mscale.distributed.watcher.POLL_S", 0.0)
    seen = []

    def hook(codes):
        seen.append(list(codes))
        raise RuntimeError("a broken console must not stop the watching")

    result = watch_workers([_Proc([None, None, 0]), _Proc([None, None, 0])], on_poll=hook)
    assert result.code == 0 and result.failed_rank is None
    assert seen == [[None, None], [None, None]]


def test_on_a_terminal_a_line_wider_than_it_is_cut_so_that_it_can_be_redrawn():
    out, clock = Tty(), Clock()
    view = view_of({}, out, clock, width=40)
    view.poll()
    line = out.getvalue()
    assert line.startswith("\rstarting 4 workers") and line.endswith("...\x1b[K")
    assert len(line) - len("\r\x1b[K") == 39


class _Started:
    """A worker `forkserver.start` returned: it has ended with exit 0."""

    pid = 1

    def poll(self) -> int:
        return 0

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


def test_the_view_draws_itself_while_the_launcher_is_still_starting_workers(tmp_path,
                                                                             monkeypatch):
    """Starting the first worker loads torch into the fork server: 5 s on an idle 2-core
    machine, 24 s on a loaded one. The launcher's thread is inside `_start` all that time, so
    the view must tick on its own; a previous attempt's markers (every worker "ready") are
    cleared before it reads any, or the view would end at once as if the start were over."""
    import functools
    import time

    from mscale.distributed import launch
    from mscale.distributed.lifeline import Lifeline

    logs = tmp_path / "logs"
    logs.mkdir()
    for rank in range(2):  # what the previous attempt's workers marked
        (logs / f"rank{rank}.startup").write_text("spawned 1.0\nimported 2.0\nready 3.0\n")
    seen_at_start = []

    def slow_start(entry, args, env, out_fd, preload):
        seen_at_start.append(read_phases(phase_file(str(logs), 1)))
        time.sleep(0.5)  # the fork server importing torch
        return _Started()

    out = io.StringIO()
    monkeypatch.setattr(launch.forkserver, "start", slow_start)
    monkeypatch.setattr(launch, "StartupView", functools.partial(
        StartupView, tick_s=0.02, plain_every_s=0.1, tty=False))
    monkeypatch.setattr(launch.sys, "stdout", out)
    job = launch.LocalJob(2, 2, [], str(logs), {}, phases=PHASES, preload=())
    lifeline = Lifeline(backlog=4)
    try:
        launch._run_workers(job, lifeline)
    finally:
        lifeline.close()
    assert seen_at_start[0] == []  # rank 1's old "ready" was gone before rank 0 started
    assert "starting 2 workers (0 s): imported 0/2, rendezvous 0/2" in out.getvalue(), \
        out.getvalue()
