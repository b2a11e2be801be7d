"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "plans"


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
