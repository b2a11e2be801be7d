"""The command recover runs (recover/child.py): its own process group, recover's SIGINT passed
on to it once, its exit code returned; `subprocess.run` SIGKILLed it on a Ctrl-C instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

JOB = ("import os, signal, sys, time\n"
       "def halt(signum, frame):\n"
       "    print('halting on', signal.Signals(signum).name, flush=True); sys.exit(1)\n"
       "signal.signal(signal.SIGINT, halt)\n"
       "open(sys.argv[1], 'w').close()\n"
       "time.sleep(60); sys.exit(0)\n")
"""A job that halts in order (exit 1) on SIGINT, as train --local does."""

RECOVER = ("import sys\n"
           "from mscale.recover.child import Child\n"
           "code = Child([sys.executable, '-c', sys.argv[1], sys.argv[2]]).wait()\n"
           "print('job exited', code, flush=True)\n")


def test_a_ctrl_c_to_recover_reaches_the_job_once_and_its_code_comes_back(tmp_path):
    ready = tmp_path / "ready"
    recover = subprocess.Popen([sys.executable, "-c", RECOVER, JOB, str(ready)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert recover.poll() is None and time.monotonic() < deadline, recover.communicate()
        time.sleep(0.02)
    os.kill(recover.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches recover's group only
    out, err = recover.communicate(timeout=30)
    assert recover.returncode == 0, err
    assert "halting on SIGINT" in out and "job exited 1" in out and "Traceback" not in err
