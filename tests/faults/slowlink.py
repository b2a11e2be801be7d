"""A slow network link, injected from outside mscale: build and configure the slowlink shim.

MegaScale calls this fault the hardest to find: one NIC sending at a fraction of its rate.
Nothing crashes and nothing logs an error; every collective that touches the node just gets
slower. To test that mscale notices, the slowness has to be real and come from outside its
code: a flag that mscale itself reads would only test that mscale reads its own flag. So
slowlink.c is an LD_PRELOAD library that paces the socket writes of one selected process
(write, writev, send, sendto, sendmsg) that leave its node to a fixed byte rate, and leaves
everything else alone (``scope="all"``: every socket write).
What mscale then measures is a slow socket, exactly what a degraded NIC looks like from above.

    shim = slowlink.build(tmp_dir)
    subprocess.run(cmd, env={**os.environ, **slowlink.env(shim, "RANK=5", 5_000_000)})
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mscale.runs.atomic import read_jsonl

SOURCE = Path(__file__).with_name("slowlink.c")
_COMPILERS = ("gcc", "cc")


def _compiler() -> str | None:
    return next((path for name in _COMPILERS if (path := shutil.which(name))), None)


def compiler_available() -> bool:
    return _compiler() is not None


def build(dest_dir: Path) -> Path:
    """Compile slowlink.c into dest_dir and return the .so; free when that source was built there.

    The file name carries a hash of the source, so an edited shim is never served stale.
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"slowlink: no C compiler found (looked for {', '.join(_COMPILERS)})")
    source = SOURCE.read_bytes()
    dest_dir.mkdir(parents=True, exist_ok=True)
    shim = dest_dir / f"slowlink-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if shim.exists():
        return shim
    # Compile to a private name and rename: a concurrent build never sees half a library.
    partial = dest_dir / f".{shim.name}.{os.getpid()}.tmp"
    cmd = [compiler, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(partial), str(SOURCE),
           "-ldl", "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"slowlink: `{' '.join(cmd)}` failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    os.replace(partial, shim)
    return shim


def build_for_test(dest_dir: Path) -> Path:
    """`build`, for a test: without a C compiler the test is skipped here, and fails in CI
    (``CI`` set), whose machine has gcc, so that a missing compiler cannot hide the tests."""
    import pytest

    if not compiler_available():
        reason = "no C compiler (gcc or cc) to build the slowlink shim"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(reason + " (CI must have one)")
        pytest.skip(reason)
    return build(dest_dir)


def env(shim: Path, match: str, bps: int, onset_file: Path | None = None,
        scope: str = "node") -> dict[str, str]:
    """The variables that make the processes where `match` ("NAME=VALUE") holds send at `bps`.

    With `onset_file`, pacing waits until that file exists (the fault strikes mid-run).
    `scope` "node": only what leaves the node is paced, as a degraded NIC slows it (under
    ``--local`` each pretend node gets its own loopback address: slowlink.c); "all": every
    socket write, the node's own loopback traffic included.
    Variables not returned (SLOWLINK_ONSET_FILE when there is no onset file) must not be
    inherited from the caller either: build the child's environment without them.
    """
    preload = ":".join(filter(None, [str(shim.resolve()), os.environ.get("LD_PRELOAD")]))
    variables = {"LD_PRELOAD": preload, "SLOWLINK_MATCH": match, "SLOWLINK_BPS": str(int(bps)),
                 "SLOWLINK_SCOPE": scope}
    if onset_file is not None:
        variables["SLOWLINK_ONSET_FILE"] = str(onset_file)
    return variables


@contextlib.contextmanager
def onset_after_step(run: Path, step: int, flag: Path) -> Iterator[None]:
    """While in the block, a thread creates ``flag`` (the shim starts pacing) once the run's
    metrics record ``step``: the fault strikes mid-run, after a clean stretch."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():  # read_jsonl: the job may be mid-append (a torn last line)
            if any(r["step"] >= step for r in read_jsonl(str(run / "metrics.jsonl"))):
                flag.touch()
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
