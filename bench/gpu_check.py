"""Every GPU check in one run, for a session lent a device: figures first, then correctness.

A session gets a GPU rarely and for minutes, so this script is built to return *something* from
any run: each check runs in its own subprocess with its own timeout (a crash or hang in one costs
that check only), the checks run in order of what the open issues need most, and a check that
would not finish inside the time budget is skipped with a line saying so. Run directories go to
``--work`` (GBs, never copied back); ``--out`` receives the report and each run's metrics.

    python3 bench/gpu_check.py --out "$OUT"          # on the GPU machine (bench/gpu_check.sh)
    .venv/bin/python bench/gpu_check.py --rehearse   # here: every check on the CPU, tiny models

``--rehearse`` runs the same code paths on the CPU with a tiny model (inductor builds CPU
kernels), so a typo or an API change is found before a GPU minute is spent; what only a GPU can
show (sync detection, fused-kernel names, async timers) is said to be unchecked, not passed.
The checks are in `bench/gpu_checks.py`; what each measures is in its docstring (the plans and
runs they share: `bench/gpu_plans.py`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules of checks
import gpu_checks  # noqa: E402
import gpu_plans  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RANK = ("FAIL", "PASS", "INFO", "SKIP")
"""A check's status: the first of these among its lines' first words (any FAIL fails it)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-check"),
                    help="report and metrics files (the device tool copies $OUT back)")
    ap.add_argument("--work", default=None, help="run directories (default: a temporary folder)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET_S", 480)),
                    help="seconds for all checks; a check that would overrun it is skipped")
    ap.add_argument("--rehearse", action="store_true", help="on the CPU with a tiny model")
    ap.add_argument("--only", nargs="*", help="run these checks only (names below)")
    ap.add_argument("--gpu", help="the GPU preset the checks run on (H200, H100, ...; 'none' for "
                    "a GPU no preset knows). Default: nvidia-smi's GPU 0; in a rehearsal the "
                    "plans' own (name another to rehearse retargeting them)")
    ap.add_argument("--check", help=argparse.SUPPRESS)  # internal: one check in this process
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Refused before the work folder exists, so a typo leaves no folder behind.
    names = args.only or [c.name for c in gpu_checks.CHECKS]
    unknown = sorted(set(names) - {c.name for c in gpu_checks.CHECKS})
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {[c.name for c in gpu_checks.CHECKS]}")
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        found = None if args.rehearse or args.gpu else gpu_plans.detect_gpu()
        gpu = args.gpu or (found[1] if found else gpu_plans.PLANS_GPU)
        ctx = gpu_plans.Context(out=out, work=work, rehearse=args.rehearse,
                                 gpu=None if gpu.lower() == "none" else gpu)
        if args.check:
            return gpu_checks.run_one(args.check, ctx)
        checks = [c for c in gpu_checks.CHECKS if c.name in names]
        return drive(checks, ctx, args, out / "gpu-check.txt", found)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def drive(checks, ctx, args, report: Path, found: tuple[str, str | None] | None = None) -> int:
    """Run each check in a subprocess, in order, within the budget; the summary table last.
    ``found``: the GPU nvidia-smi named and its preset (`gpu_plans.detect_gpu`)."""
    t0 = time.monotonic()
    results: list[tuple[str, str, float]] = []
    with open(report, "a", buffering=1) as log:
        def say(line: str) -> None:
            print(line, flush=True)
            log.write(line + "\n")

        say(f"gpu_check {'(rehearsal on the CPU)' if ctx.rehearse else ''} at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}; budget {args.budget:.0f} s; "
            f"checks: {', '.join(c.name for c in checks)}")
        say(gpu_line(ctx, found))
        missing = missing_requirements()
        if missing:  # found in a second here, not as a crash minutes into a run
            say(f"FAIL: not installed here, though pyproject.toml requires them: "
                f"{', '.join(missing)} (add them to scripts/gpu-wheels.sh)")
            results.append(("requirements", "FAIL", 0.0))
        for check in checks:
            left = args.budget - (time.monotonic() - t0)
            if left < check.seconds:
                say(f"== {check.name}: SKIP, {left:.0f} s of the budget left and it takes "
                    f"~{check.seconds} s")
                results.append((check.name, "SKIP", 0.0))
                continue
            say(f"== {check.name}: {check.what}")
            status, took = run_child(check, ctx, args, say, timeout=min(left, 3 * check.seconds))
            results.append((check.name, status, took))
        say("== summary: " + "; ".join(f"{n} {s} ({t:.0f} s)" for n, s, t in results)
            + f"; {time.monotonic() - t0:.0f} s in all")
    return 1 if any(s == "FAIL" for _, s, _ in results) else 0


def gpu_line(ctx, found: tuple[str, str | None] | None) -> str:
    """What the figures are measured on, and against which peak: the report's second line."""
    plans = gpu_plans.PLANS_GPU
    if ctx.gpu is None:
        return (f"WARNING: {found[0] if found else 'this GPU'} has no preset "
                "(src/mscale/config/gpus.py): plans as written, every MFU below is against the "
                f"{plans}'s peak, not this GPU's")
    seen = f"{found[0]} (preset {ctx.gpu})" if found else f"preset {ctx.gpu}"
    return (f"GPU: {seen}; " + ("the plans as written" if ctx.gpu == plans else
                                f"the {plans} plans retargeted to it (their files in --work)")
            + f"; files under --out start {ctx.prefix}_")


def missing_requirements(version=None) -> list[str]:
    """The project's requirements (pyproject.toml) this interpreter lacks or has too old.
    The GPU image brings its own packages and takes the rest as carried wheels; a name missing
    from both crashed all three training checks of a lease once the engine began to use it.
    ``version``: name → installed version or None (default: importlib.metadata)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    def installed(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    version = version or installed
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for req in map(Requirement, deps):
        have = version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(str(req) + ("" if have is None else f" (have {have})"))
    return out


def run_child(check, ctx, args, say, timeout: float) -> tuple[str, float]:
    """One check in a fresh interpreter (a CUDA fault or a hang costs that check only)."""
    cmd = [sys.executable, "-u", __file__, "--check", check.name, "--out", str(ctx.out),
           "--work", str(ctx.work), "--gpu", ctx.gpu or "none"] + (
               ["--rehearse"] if ctx.rehearse else [])
    t0 = time.monotonic()
    seen: set[str] = set()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = t0 + timeout
        for line in _lines(proc, deadline):
            say("   " + line)
            word = line.split(":", 1)[0].split(" ", 1)[0]
            if word in RANK:
                seen.add(word)
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        say(f"   FAIL: {check.name} did not finish within {timeout:.0f} s (killed)")
        return "FAIL", time.monotonic() - t0
    took = time.monotonic() - t0
    if code != 0:
        say(f"   FAIL: {check.name} exited with code {code}")
        return "FAIL", took
    return next((w for w in RANK if w in seen), "DONE"), took


def _lines(proc, deadline: float):
    """The child's output lines until it closes stdout or the deadline passes."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        if not sel.select(timeout=min(left, 5.0)):
            continue
        line = proc.stdout.readline()
        if not line:
            return
        yield line.rstrip("\n")


if __name__ == "__main__":
    raise SystemExit(main())
