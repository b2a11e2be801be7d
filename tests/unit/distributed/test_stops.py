"""The operator's stop signals to a ``--local`` launcher (distributed/stops.py): the first asks
the workers to stop (SIGTERM), a second Ctrl-C kills them; and a real launcher whose workers
ignore the request (one stuck in a long save) is still stopped by the second Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mscale.distributed.launch import pid_file
from mscale.distributed.stops import REPEAT_S, StopRequests, ended_by_stop, forwarded_signals
from tests.conftest import REPO
from tests.unit.distributed.test_lifeline import DEADLINE_S, _cleanup, _gone, _wait_until


class FakeWorker:
    def __init__(self, running: bool = True):
        self.code = None if running else 0
        self.got: list[int] = []

    def poll(self):
        return self.code

    def send_signal(self, sig: int) -> None:
        self.got.append(sig)

    def kill(self) -> None:
        self.got.append(signal.SIGKILL)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_first_stop_is_passed_on_as_sigterm_once_and_said_once():
    procs = [FakeWorker(), FakeWorker(running=False)]
    stops = StopRequests(procs, notice=lambda name: f"asked by {name}")
    stops.handler(signal.SIGINT, None)
    assert procs[0].got == []  # the handler only records: the watching loop delivers
    stops.deliver()
    stops.deliver()
    assert procs[0].got == [signal.SIGTERM] and procs[1].got == []  # an ended one is left
    assert stops.first_name == "SIGINT" and not stops.forced
    assert stops.take_notes() == ["asked by SIGINT"] and stops.take_notes() == []


def test_the_workers_are_told_the_launchers_signal_before_its_sigterm():
    procs, told = [FakeWorker()], []
    stops = StopRequests(procs, tell=lambda name: told.append((name, list(procs[0].got))))
    stops.handler(signal.SIGHUP, None)
    stops.deliver()
    stops.deliver()
    assert told == [("SIGHUP", [])] and procs[0].got == [signal.SIGTERM]


def test_a_second_ctrl_c_kills_but_a_repeat_within_a_second_is_the_same_press():
    procs, clock = [FakeWorker()], Clock()
    stops = StopRequests(procs, clock=clock)
    stops.handler(signal.SIGINT, None)
    clock.t += REPEAT_S / 2
    stops.handler(signal.SIGINT, None)  # GNU timeout passing the terminal's SIGINT on again
    stops.handler(signal.SIGTERM, None)
    stops.deliver()
    assert procs[0].got == [signal.SIGTERM] and not stops.forced
    clock.t += REPEAT_S
    stops.handler(signal.SIGINT, None)
    stops.deliver()
    assert stops.forced and procs[0].got == [signal.SIGTERM, signal.SIGKILL]
    assert len(stops.take_notes()) == 2


def test_a_stop_asked_before_any_worker_started_reaches_them_when_delivered():
    procs: list[FakeWorker] = []
    stops = StopRequests(procs)
    stops.deliver()  # nobody asked: nothing sent
    stops.handler(signal.SIGINT, None)
    procs.append(FakeWorker())
    stops.deliver()
    assert procs[0].got == [signal.SIGTERM]


def test_what_a_stop_explains():
    assert all(ended_by_stop(c, forced=False) for c in (None, 0, 1, 2, 130, -2, -15, -1))
    assert not ended_by_stop(-9, forced=False) and ended_by_stop(-9, forced=True)
    assert not any(ended_by_stop(c, forced=True) for c in (3, -11, 255))


def test_nohup_keeps_sighup_ignored():
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert signal.SIGHUP not in forwarded_signals()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in forwarded_signals()
    finally:
        signal.signal(signal.SIGHUP, before)


STUCK_WORKER = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck in a long save: the request waits
signal.signal(signal.SIGINT, signal.SIG_IGN)
print('ready', flush=True)
time.sleep(120)
"""

LAUNCHER = """
import json, sys
from mscale.distributed.launch import run_local_workers
result = run_local_workers(2, 1, [], sys.argv[1], {}, entry=sys.argv[2], phases=(), preload=())
print('result', json.dumps([result.returncodes, result.stop_signal, result.forced]), flush=True)
"""


def test_a_second_ctrl_c_stops_workers_that_ignore_the_request(tmp_path):
    logs, console = tmp_path / "logs", tmp_path / "console.txt"
    with open(console, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(logs), STUCK_WORKER],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pids: list[int] = []
    try:
        _wait_until(lambda: all((logs / f"rank{r}.log").exists() and "ready" in
                                (logs / f"rank{r}.log").read_text() for r in range(2)),
                    "both workers ready")
        pids = [int(Path(pid_file(str(logs), r)).read_text()) for r in range(2)]
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        _wait_until(lambda: "stop requested (SIGINT)" in console.read_text(), "the notice")
        os.killpg(proc.pid, signal.SIGINT)  # a repeat of the same press: still only asked
        time.sleep(REPEAT_S + 0.2)
        assert proc.poll() is None and not any(_gone(p) for p in pids)  # asked, not forced
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=DEADLINE_S)
    finally:
        _cleanup(proc, pids)
    text = console.read_text()
    assert "second Ctrl-C: stopping the workers now" in text
    result = json.loads(text.split("result ", 1)[1].splitlines()[0])
    assert result == [[-signal.SIGKILL, -signal.SIGKILL], "SIGINT", True]


def test_a_ctrl_c_before_the_entry_handles_it_is_130_not_1(tmp_path):
    """A forked worker interrupted before its command's own handling: multiprocessing's
    bootstrap would exit 1, which reads as "halted on request, checkpoint saved"."""
    p = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"),
                        "raise KeyboardInterrupt"], cwd=REPO, capture_output=True, text=True,
                       timeout=DEADLINE_S)
    codes = json.loads(p.stdout.split("result ", 1)[1].splitlines()[0])[0]
    # the first to end is 130; the launcher may stop the other (SIGTERM) before it ends alike
    assert 130 in codes and set(codes) <= {130, -signal.SIGTERM}, p.stdout + p.stderr
