"""A launch command that recover runs (``recover supervise``'s CMD, ``recover --execute``'s
relaunch): in its own process group, with recover's SIGINT and SIGTERM passed on to its leader.

A terminal's Ctrl-C reaches the foreground process group, recover alone here; passed on, it
reaches ``train --local`` once, which halts every worker at its next step with a checkpoint (a
second Ctrl-C stops them at once). ``subprocess.run`` would instead have taken the
KeyboardInterrupt and SIGKILLed the launcher, whose workers then died without a checkpoint as
if their launcher had crashed.
"""

from __future__ import annotations

import os
import signal
import subprocess

from mscale.errors import EXIT_INTERRUPTED, MscaleError

PASSED_ON = (signal.SIGINT, signal.SIGTERM)


def contract_code(rc: int) -> int:
    """A job's exit status as the CLI's codes say it: killed by SIGINT is 130, as a shell
    reports it. Python ends a process that way when a Ctrl-C lands where nothing catches it: a
    Ctrl-C passed on just as the relaunch ends. Anything else as it is."""
    return EXIT_INTERRUPTED if rc == -signal.SIGINT else rc


class Child:
    """CMD in its own process group; recover's SIGINT/SIGTERM are passed on to its leader
    (``train --local`` turns them into a halt of every worker, srun into a step cancel)."""

    def __init__(self, command: list[str], cwd: str | None = None, stdout=None,
                 field: str = "CMD",
                 fix: str = "check the command after -- (a path, or a program on PATH)"):
        try:
            # no stdin: in a process group of its own, a read of the terminal (srun forwards
            # stdin to its tasks) would stop it with SIGTTIN; no launch command needs input
            self.proc = subprocess.Popen(command, process_group=0, cwd=cwd, stdout=stdout,
                                         stdin=subprocess.DEVNULL)
        except OSError as e:
            raise MscaleError(f"cannot run {command[0]}: {e.strerror or e}", field=field,
                              fix=fix) from None

    def forward(self, signum: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        """Its exit code, recover's SIGINT and SIGTERM passed on to it meanwhile."""
        old = {s: signal.signal(s, lambda signum, frame: self.forward(signum))
               for s in PASSED_ON}
        try:
            return self.proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def reap_group(self) -> None:
        """Leftovers of the group once its leader is gone (a worker the leader did not stop)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
