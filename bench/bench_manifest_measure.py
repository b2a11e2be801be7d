"""bench_manifest.py's measuring: each step's wall seconds and its own peak RSS, in the child
process that runs it (bench_manifest_commit.py, bench_manifest_resume.py).
"""

from __future__ import annotations

import gc
import resource
import time


def rss_mb() -> float:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def peak_mb() -> float:
    """The high-water mark of the resident set (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def reset_peak() -> None:
    """Start ``ru_maxrss`` again from the current RSS (Linux >= 4.0), so each step's peak is its
    own and not an earlier step's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Steps:
    """Timed steps of one child process, each with its own peak RSS."""

    def __init__(self) -> None:
        gc.collect()
        self.base = rss_mb()
        self.rows: list[dict] = []

    def run(self, name: str, fn):
        gc.collect()
        reset_peak()
        held = rss_mb()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        self.rows.append({"step": name, "wall_s": wall, "held_mb": held,
                          "peak_mb": max(held, peak_mb()),
                          "base_mb": self.base})
        return out
