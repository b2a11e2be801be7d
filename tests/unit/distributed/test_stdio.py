"""A console that went away costs the view, never the job (distributed/stdio.py): real pipes
and a real terminal, closed under the writer."""

from __future__ import annotations

import errno
import io
import os
import pty
import stat
import sys

import pytest

from mscale.distributed.stdio import BestEffortStream, console_gone, guard_std_streams


def _devnull_rdev() -> int:
    return os.stat(os.devnull).st_rdev


def _closed_pipe() -> io.TextIOWrapper:
    """A text stream on a pipe whose reader is gone (``mscale train ... | head`` done)."""
    r, w = os.pipe()
    os.close(r)
    return os.fdopen(w, "w")


def test_a_pipe_whose_reader_went_away_is_dropped_with_one_note():
    raw, notes = _closed_pipe(), []
    out = BestEffortStream(raw, "stdout", note=notes.append)
    try:
        print("step 1/10  loss 5.5", file=out, flush=True)  # EPIPE: dropped, not raised
        assert out.gone
        print("step 2/10  loss 5.4", file=out, flush=True)  # nothing tried any more
        assert len(notes) == 1 and "stdout is gone" in notes[0]
        # the descriptor now points at /dev/null: C writers and the original stream are quiet
        st = os.fstat(raw.fileno())
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == _devnull_rdev()
        raw.write("buffered\n")
        raw.flush()
    finally:
        raw.close()


def test_a_terminal_that_hung_up_is_dropped():
    master, slave = pty.openpty()
    raw = os.fdopen(slave, "w")
    os.close(master)  # the terminal is gone: writes to it fail with EIO
    out = BestEffortStream(raw, "stdout")
    try:
        out.write("step 1\n")
        out.flush()
        assert out.gone
    finally:
        raw.close()


class _Failing(io.StringIO):
    """A stream whose writes fail with ``err`` on the descriptor ``fd``."""

    def __init__(self, err: int, fd: int):
        super().__init__()
        self.err, self.fd = err, fd

    def write(self, s):
        raise OSError(self.err, os.strerror(self.err))

    def fileno(self):
        return self.fd


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_failing_log_file_is_still_an_error(tmp_path, err):
    """EIO and ENOSPC on a regular file are the disk's trouble, which the job must hear of."""
    with open(tmp_path / "rank1.log", "w") as f:
        out = BestEffortStream(_Failing(err, f.fileno()), "stdout")
        with pytest.raises(OSError) as e:
            out.write("x")
        assert e.value.errno == err and not out.gone


def test_console_gone_reads_the_errno_and_the_device():
    with open(os.devnull, "w") as tty_like, open(__file__) as regular:
        assert console_gone(BrokenPipeError(errno.EPIPE, "x"))
        assert console_gone(OSError(errno.EIO, "x"), tty_like.fileno())
        assert not console_gone(OSError(errno.EIO, "x"), regular.fileno())
        assert not console_gone(OSError(errno.EIO, "x"))
        assert not console_gone(ValueError("I/O operation on closed file"))


def test_the_std_streams_are_wrapped_once_and_restored():
    before = sys.stdout, sys.stderr
    restore = guard_std_streams()
    try:
        assert isinstance(sys.stdout, BestEffortStream) and sys.stdout.wrapped is before[0]
        assert isinstance(sys.stderr, BestEffortStream) and sys.stderr.wrapped is before[1]
        again = guard_std_streams()  # already wrapped: nothing changes
        assert sys.stdout.wrapped is before[0]
        again()
        assert isinstance(sys.stdout, BestEffortStream)
    finally:
        restore()
    assert (sys.stdout, sys.stderr) == before
