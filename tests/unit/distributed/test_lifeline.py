"""A --local worker never outlives its launcher (distributed/lifeline.py), and SIGHUP to the
launcher is a stop request like SIGTERM (distributed/launch.py): with real processes, no torch.

Every wait is a deadline on an event or a state, never a sleep that races the thing it waits for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mscale.distributed import lifeline
from mscale.distributed.launch import pid_file
from mscale.distributed.lifeline import (LIFELINE_ENV, LOG_FILE_ENV, LauncherWatch, Lifeline,
                                         say_in_log, watch_launcher)
from tests.conftest import REPO

DEADLINE_S = 30.0
"""Far above what any of these takes (tens of milliseconds), far below a hung test."""


def _state(pid: int) -> str | None:
    """The process's state letter, None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z")  # a zombie has ended: only its parent has not reaped it


def _wait_until(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"not within {deadline_s} s: {what}"
        time.sleep(0.02)


class _Seen:
    """An ``on_gone`` that records the reason instead of ending the process."""

    def __init__(self):
        self.why: list[str] = []
        self.event = threading.Event()

    def __call__(self, why: str) -> None:
        self.why.append(why)
        self.event.set()


LAUNCHER = """
import sys, time
from mscale.distributed.lifeline import Lifeline
line = Lifeline()
print(line.address, flush=True)
while True:
    if sys.argv[1] == "accept":
        line.accept()
    time.sleep(0.05)
"""


@pytest.mark.parametrize("accepts", ["accept", "never-accept"])
def test_the_watch_fires_when_the_launcher_is_sigkilled(accepts):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, accepts], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        seen = _Seen()
        watch = LauncherWatch(address, seen).start()
        # connected and alive: nothing to say (a negative, checked for a moment)
        assert not seen.event.wait(0.3) and not watch.gone.is_set()
        proc.kill()
        assert seen.event.wait(DEADLINE_S), "the launcher's death was not seen"
        assert watch.gone.is_set() and "its connection to this worker closed" in seen.why[0]
        assert len(seen.why) == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_launcher_gone_before_the_worker_connects_is_seen_at_once():
    line = Lifeline()
    address = line.address
    line.close()
    seen = _Seen()
    LauncherWatch(address, seen).start()
    assert seen.event.wait(DEADLINE_S)
    assert "no longer accepts" in seen.why[0]


def test_a_closed_watch_says_nothing():
    with Lifeline() as line:
        seen = _Seen()
        watch = LauncherWatch(line.address, seen).start()
        _wait_until(lambda: line.accept() == 1, "the connection accepted")
        watch.close()
        watch._thread.join(DEADLINE_S)
        assert not watch._thread.is_alive() and not seen.why


def test_a_launcher_that_saw_a_worker_end_answers_alive_at_once():
    """The peers of a dead worker ask whether the launcher is gone too. Without the launcher's
    word each waited out its whole timeout, hop by hop (6 s at world 8); with it, at once."""
    with Lifeline() as line:
        seen = _Seen()
        watch = LauncherWatch(line.address, seen).start()
        _wait_until(lambda: line.accept() == 1, "the connection accepted")
        t0 = time.monotonic()
        assert watch.wait_gone(0.2) is False and time.monotonic() - t0 >= 0.2  # no word: waits
        line.tell_alive()
        line.tell_alive()  # once: a second call sends nothing
        t0 = time.monotonic()
        assert watch.wait_gone(DEADLINE_S) is False
        assert time.monotonic() - t0 < 5 and watch.alive.is_set() and not seen.why
        late = LauncherWatch(line.address, _Seen()).start()  # connects after the word
        _wait_until(lambda: line.accept() == 2, "the late connection accepted")
        assert late.wait_gone(DEADLINE_S) is False and late.alive.is_set()
    # the launcher's end is still seen after it said it was alive
    assert seen.event.wait(DEADLINE_S) and watch.gone.is_set()
    assert watch.wait_gone(0) is True


def test_the_launcher_names_its_stop_signal_to_every_worker_once():
    """A SIGHUP or SIGINT to the launcher alone reaches the workers as SIGTERM: the word before
    it names the launcher's signal; it is no "alive" answer."""
    with Lifeline() as line:
        watch = LauncherWatch(line.address, _Seen()).start()
        _wait_until(lambda: line.accept() == 1, "the connection accepted")
        line.tell_stop("SIGHUP")
        line.tell_stop("SIGINT")  # once: the first stop is the one passed on
        _wait_until(lambda: watch.stop_said is not None, "the stop signal heard")
        assert watch.stop_said == "SIGHUP" and not watch.alive.is_set()
        late = LauncherWatch(line.address, _Seen()).start()  # connects after the word
        _wait_until(lambda: line.accept() == 2, "the late connection accepted")
        _wait_until(lambda: late.stop_said == "SIGHUP", "the late worker told too")
        line.tell_alive()
        _wait_until(watch.alive.is_set, "alive heard after the stop word")
        assert watch.stop_said == "SIGHUP"


@pytest.mark.parametrize("environ", [
    {},  # a plain process
    {"MSCALE_LAUNCHER": "torchrun", LIFELINE_ENV: "@x"},  # not ours: the variable leaked
    {"MSCALE_LAUNCHER": "local"},  # no lifeline given
])
def test_only_a_local_launchers_worker_is_armed(environ):
    before = signal.getsignal(signal.SIGHUP)
    assert watch_launcher(_Seen(), environ=environ) is None
    assert signal.getsignal(signal.SIGHUP) == before  # nothing changed


def test_an_armed_worker_leaves_sighup_to_its_launcher():
    before = signal.getsignal(signal.SIGHUP)
    try:
        with Lifeline() as line:
            seen = _Seen()
            watch = watch_launcher(seen, environ={"MSCALE_LAUNCHER": "local",
                                                  LIFELINE_ENV: line.address})
            assert watch is not None and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            watch.close()
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_line_goes_into_the_workers_log_file(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_bytes(b"step 1\n")
    say_in_log("error: the launcher is gone\n", environ={LOG_FILE_ENV: str(log)})
    assert log.read_text() == "step 1\nerror: the launcher is gone\n"


# -- a real launcher (run_local_workers) and its workers, forked and spawned -----------------

WORKER = """
import os, signal, sys, time
from mscale.distributed.lifeline import launcher_stop_signal, watch_launcher
asked = []
signal.signal(signal.SIGTERM, lambda *a: asked.append(1))
watch_launcher()
print('armed', flush=True)
end = time.monotonic() + 120
while not asked and time.monotonic() < end:
    time.sleep(0.05)
heard_by = time.monotonic() + 5
while asked and launcher_stop_signal() is None and time.monotonic() < heard_by:
    time.sleep(0.01)  # the word went before the SIGTERM; its reading thread may come after
print('launcher said', launcher_stop_signal(), flush=True)
sys.exit(1 if asked else 4)
"""
"""A worker that arms the watch and waits; SIGTERM (the launcher's stop request) ends it with
1 ("stopped on request"), as a training worker's halt does, once it heard which signal the
launcher got."""

LOCAL_LAUNCHER = """
import json, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as from a terminal: the runner may run under nohup
from mscale.distributed.launch import run_local_workers
result = run_local_workers(2, 1, [], sys.argv[1], {}, entry=sys.argv[2], phases=(),
                           preload=())
print('codes', json.dumps(result.returncodes), flush=True)
sys.exit(result.code)
"""


def _launch(tmp_path: Path, fork: bool) -> tuple[subprocess.Popen, list[int], Path]:
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k != "MSCALE_SPAWN_WORKERS"}
    if not fork:
        env["MSCALE_SPAWN_WORKERS"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", LOCAL_LAUNCHER, str(logs), WORKER],
                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def armed() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return all((logs / f"rank{r}.log").exists()
                   and "armed" in (logs / f"rank{r}.log").read_text() for r in range(2))

    _wait_until(armed, "both workers armed")
    pids = [int(Path(pid_file(str(logs), r)).read_text()) for r in range(2)]
    return proc, pids, logs


def _cleanup(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_workers_stop_when_their_launcher_is_sigkilled(tmp_path, fork):
    proc, pids, logs = _launch(tmp_path, fork)
    try:
        proc.kill()  # SIGKILL: nothing of the launcher runs again
        proc.wait()
        _wait_until(lambda: all(_gone(p) for p in pids), "the workers gone")
        for r in range(2):
            assert "the --local launcher is gone" in (logs / f"rank{r}.log").read_text()
    finally:
        _cleanup(proc, pids)


@pytest.mark.parametrize("sig, group", [(signal.SIGHUP, False), (signal.SIGHUP, True),
                                        (signal.SIGTERM, True)],
                         ids=["sighup-launcher", "sighup-group", "sigterm-group"])
def test_a_stop_signal_to_the_launcher_or_its_group_ends_the_workers_with_1(tmp_path, sig,
                                                                           group):
    """SIGHUP to the launcher, or to its whole process group as a closed terminal sends it, and
    SIGTERM to the group (`timeout`, `kill -TERM -- -PGID`): the workers are asked to stop
    (SIGTERM) and end with 1, read through a fork server that the signal did not kill (it
    would report 255)."""
    proc, pids, logs = _launch(tmp_path, fork=True)
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 1, out
        assert "codes [1, 1]" in out
        for r in range(2):  # the launcher's own signal, not the SIGTERM it passed on
            said = f"launcher said {signal.Signals(sig).name}"
            assert said in (logs / f"rank{r}.log").read_text()
    finally:
        _cleanup(proc, pids)


def test_report_is_bounded(monkeypatch):
    """A report that hangs (a stalled filesystem) cannot keep a worker alive: the deadline
    timer ends the process."""
    fired = threading.Event()
    monkeypatch.setattr(lifeline.os, "_exit", lambda code: fired.set())
    lifeline.exit_after(0.05)
    assert fired.wait(DEADLINE_S)
