"""Shared test helpers."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "plans"

# Off a terminal the CLI takes its width from COLUMNS (cli/output.py), and the tests check its
# default width (160, tables whole). pytest-xdist's workers start with COLUMNS=80 (as do some
# shells that export it): drop it before any test imports the CLI or starts the binary.
os.environ.pop("COLUMNS", None)


def in_ci() -> bool:
    """``CI`` is set (and not ``0``/``false``/``no``): a test that cannot run here must fail,
    not skip, so that a missing privilege or tool cannot hide it from CI."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``1m``, ``96k``) mounted on ``path`` for the block, for the
    full-disk paths (ENOSPC from the kernel, not a mock). Mounting needs root (CAP_SYS_ADMIN):
    where it fails the test skips, except in CI, where it fails, as CI runs as root."""
    path.mkdir(parents=True, exist_ok=True)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if m.returncode:
        reason = f"cannot mount a {size} tmpfs here ({(m.stderr or m.stdout).strip()})"
        if in_ci():
            pytest.fail(f"{reason}: CI (CI={os.environ['CI']}) must run the real full-disk "
                        "tests, as root", pytrace=False)
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(autouse=True)
def _stop_signal_handlers_restored():
    """Each test starts with the stop signals' handlers the session had: code run in process (a
    worker's failure edge ignores SIGTERM for good) must not change what a later test's signal
    does (a watch test's SIGTERM, ignored, left it polling until the suite's timeout)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n)]
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def cli():
    """Run the mscale CLI in-process; returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    from mscale.cli.main import run

    def invoke(*args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run(list(args))
        return code, out.getvalue(), err.getvalue()

    return invoke
