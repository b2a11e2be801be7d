"""Benchmark: what one ``mscale`` command costs to start, in CPU seconds.

Every command loads the CLI (typer, rich, pydantic and the config schemas) before it does
anything; the test suite starts the CLI hundreds of times, and an operator's cron check once a
minute. This runs a few cheap commands ``--repeats`` times each and prints the median CPU time
(user + system of the child, from ``resource.getrusage``) against two references in the same
script: the floor (a bare interpreter that imports typer, rich and pydantic, which no command can
go below) and, with ``--rev``, the same commands at another commit (a ``git worktree`` of it,
run with this venv). Not a test.

    .venv/bin/python bench/bench_cli_start.py                   # this tree against the floor
    .venv/bin/python bench/bench_cli_start.py --rev 5be928b     # ... and against that commit
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = (("--help",), ("plan", "--help"), ("watch", "--help"), ("ckpt", "ls", "{run}"))
FLOOR = ("-c", "import typer, rich.console, pydantic")


def cpu_of(argv: list[str], env: dict, repeats: int) -> float:
    """Median CPU seconds (user + system) of ``argv`` over ``repeats`` runs."""
    samples = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        samples.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(samples)


def empty_run(root: Path) -> str:
    """A run directory with an empty ckpt/ (``ckpt ls`` lists nothing: start-up cost alone)."""
    run = root / "run"
    (run / "ckpt").mkdir(parents=True)
    return str(run)


def measure(src: Path, run: str, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = {}
    for words in COMMANDS:
        args = [w.format(run=run) for w in words]
        out["mscale " + " ".join(words)] = cpu_of([sys.executable, "-m", "mscale", *args], env,
                                                  repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rev", help="also measure this commit (a git worktree of it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = empty_run(root)
        floor = cpu_of([sys.executable, *FLOOR], dict(os.environ), args.repeats)
        now = measure(REPO / "src", run, args.repeats)
        then = None
        if args.rev:
            tree = root / "rev"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach",
                            str(tree), args.rev], check=True)
            try:
                then = measure(tree / "src", run, args.repeats)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=False)
    print(f"floor (typer + rich + pydantic imported): {floor:.2f} s CPU, median of "
          f"{args.repeats}")
    rev = f" {args.rev} | this / {args.rev} |" if then else ""
    print(f"| command | this tree | / floor |{rev}")
    print("|---" * (5 if then else 3) + "|")
    for name, cpu in now.items():
        row = f"| `{name}` | {cpu:.2f} s | {cpu / floor:.2f} |"
        if then:
            row += f" {then[name]:.2f} s | {cpu / then[name]:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
