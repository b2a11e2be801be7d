"""The console is a view, not the record: writing to it never stops a job.

A training job's record is its run directory (logs, metrics, events, checkpoints); its console
(stdout/stderr) is where an operator watches it. When the terminal goes away — an ssh session
closed, ``mscale train ... | head`` done reading, a ``--local`` launcher that read rank 0's
output gone — a write to it fails (``EPIPE``, or ``EIO`` from a terminal that hung up), and an
uncaught ``BrokenPipeError`` from a progress line used to end a healthy multi-hour run (and was
then read as a network fault). `BestEffortStream` wraps ``sys.stdout``/``sys.stderr``: the first
such failure marks the stream gone, points its file descriptor at ``/dev/null`` (so later writes,
by Python or by C++ libraries writing to the descriptor, and the bytes still buffered, go nowhere
quietly), says so once on the other stream when that one still works, and the job goes on. Any
other failure (a full disk under a log file) still raises: that one the job must hear about.

An operator who wants the job stopped when the terminal closes has the signal for it: SIGHUP
(the ``--local`` launcher treats it as SIGTERM: checkpoint, then stop; docs/train.md).

No torch here: the ``--local`` launcher installs it too (docs/architecture.md, "Launchers import
no torch").
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Callable, TextIO

GONE_ERRNOS = (errno.EPIPE, errno.ECONNRESET)
"""Write errors that mean the reader of a pipe or socket went away."""


def console_gone(exc: BaseException, fd: int | None = None) -> bool:
    """Whether ``exc``, raised by a write to the console on ``fd``, means the console is gone:
    its reader closed the pipe or socket (``EPIPE``, ``ECONNRESET``), or the terminal hung up
    (``EIO`` on a character device; ``EIO`` on a file is a storage error and is not this)."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in GONE_ERRNOS:
        return True
    if exc.errno == errno.EIO and fd is not None:
        try:
            return stat.S_ISCHR(os.fstat(fd).st_mode)
        except OSError:
            return False
    return False


def why_gone(exc: OSError) -> str:
    """A few words for the note (no errno names or strerror text: recover reads logs for those)."""
    return "the terminal hung up" if exc.errno == errno.EIO else "its reader went away"


class BestEffortStream:
    """A text stream whose writes cannot fail because the console went away (module docstring).

    Everything else (``fileno``, ``isatty``, ``encoding``, ``buffer``, ...) is the wrapped
    stream's. ``note``: called once, with a line, when the stream is found gone."""

    def __init__(self, stream: TextIO, name: str,
                 note: Callable[[str], None] | None = None):
        self._stream, self._name, self._note = stream, name, note
        self.gone = False

    @property
    def wrapped(self) -> TextIO:
        return self._stream

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.gone:
            return
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)

    def _failed(self, exc: OSError) -> None:
        fd = self._fileno()
        if not console_gone(exc, fd):
            raise exc
        self.gone = True
        if fd is not None:
            _to_devnull(fd)
            try:  # what the stream still buffers now drains into /dev/null
                self._stream.flush()
            except (OSError, ValueError):
                pass
        if self._note is not None:
            try:
                self._note(f"note: {self._name} is gone ({why_gone(exc)}): what is written to it "
                           "is dropped from here on, and the job goes on; its run directory "
                           "keeps the record\n")
            except Exception:  # noqa: BLE001 - a note must not become the failure
                pass

    def _fileno(self) -> int | None:
        try:
            return self._stream.fileno()
        except (AttributeError, OSError, ValueError):
            return None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _to_devnull(fd: int) -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


def guard_std_streams() -> Callable[[], None]:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in `BestEffortStream` (each notes its loss on the
    other); returns a function that puts the original streams back. Already wrapped: nothing
    is changed. A stream found gone has its descriptor on /dev/null, so the original is then
    harmless to write to as well."""
    saved = sys.stdout, sys.stderr
    if isinstance(sys.stdout, BestEffortStream) or isinstance(sys.stderr, BestEffortStream):
        return lambda: None
    out = BestEffortStream(sys.stdout, "stdout", note=lambda line: _note_on(err, line))
    err = BestEffortStream(sys.stderr, "stderr", note=lambda line: _note_on(out, line))
    sys.stdout, sys.stderr = out, err

    def restore() -> None:
        if sys.stdout is out:
            sys.stdout = saved[0]
        if sys.stderr is err:
            sys.stderr = saved[1]

    return restore


def _note_on(other: BestEffortStream, line: str) -> None:
    if not other.gone:
        other.write(line)
        other.flush()
