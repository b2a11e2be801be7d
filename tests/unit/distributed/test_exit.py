"""distributed/init.py `shutdown_and_exit`: a clean exit leaves no warning on the console.

A compiled model's process holds a named semaphore (tqdm's process-shared lock, made whenever the
start method is not fork); ``os._exit`` skips multiprocessing's finalizers, and its resource
tracker then prints "leaked semaphore objects" after the job's closing line."""

from __future__ import annotations

import subprocess
import sys

HOLD_A_SEMAPHORE = """
import multiprocessing as mp, os, sys
mp.set_start_method("forkserver")
lock = mp.get_context().RLock()  # what tqdm makes under torch.compile
if sys.argv[1] == "mscale":
    from mscale.distributed.init import shutdown_and_exit
    shutdown_and_exit(0)
os._exit(0)
"""


def _stderr(how: str) -> str:
    p = subprocess.run([sys.executable, "-c", HOLD_A_SEMAPHORE, how], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_a_clean_exit_releases_named_semaphores():
    assert "leaked semaphore" in _stderr("bare")  # the control: os._exit alone leaks it
    assert _stderr("mscale") == ""
