"""Storage: can this node write the plan's checkpoint in time, and is there room for it?

A checkpoint that takes longer to write than the interval between saves never finishes before the
next one starts; `mscale plan` chose that interval (Young/Daly, raised to at least the write
time) assuming a storage bandwidth. This check measures what one node really gets — write,
fsync, read back — through the same fsspec layer the checkpointer uses, while every node
measures at the same time (preflight runs it on each node's local rank 0 at once), and judges
it against the node's share of a resumable checkpoint over that interval.

Everything is written under a fresh ``.preflight-<id>`` directory and removed afterwards, along
with the checkpoint directory itself if the probe had to create it: preflight leaves nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mscale.config.plan import Plan
from mscale.config.preflight import CheckResult, Status
from mscale.errors import MscaleError
from mscale.planner.constants import CHECKPOINT_BYTES_PER_PARAM
from mscale.planner.goodput import advise
from mscale.runs.atomic import _is_object_store, fs_and_path
from mscale.runs.targets import check_output

PROBE_BYTES = {"quick": 64 << 20, "full": 1 << 30}
"""Bytes written and read back per node: enough to pass the first caches and per-request
overheads, small enough that ``--level quick`` stays quick on a slow store."""
BLOCK_BYTES = 8 << 20
"""One write/read call; the block is random so that compression cannot flatter the store."""
SYNC_BYTES = 64 << 20
"""With a time budget, the write is made durable every this many bytes, so that the final
fsync of a local mount cannot run far past the budget (at 9 MB/s: 7 s more)."""
HEADROOM = 1.5
"""Below this multiple of the need: WARNING. The write would then take more than 2/3 of the
interval, so any slowdown (other jobs on the store) delays the next checkpoint. An assumption."""
WHAT = "the checkpoint URL"
BUDGET_SHARE = 0.3
"""Of the job's ``--timeout``, what the write and, apart, the read may each take: the node's
other ranks wait for its host checks in a collective bound by that timeout, so a probe of a
slow store that ran on to its full size (1 GiB at ``full``: 120 s at 9 MB/s) failed the whole
preflight (UNKNOWN, exit 3) instead of judging the store. Past it the probe stops, judged on
the bytes it moved."""


@dataclass(frozen=True)
class StorageNeed:
    """What one node must write per checkpoint, and in how long."""

    node_bytes: float
    total_bytes: float
    target_s: float
    source: str
    """Where ``target_s`` comes from, for the report."""

    @property
    def bytes_per_s(self) -> float:
        return self.node_bytes / self.target_s


def storage_need(plan: Plan) -> StorageNeed:
    """A resumable checkpoint's bytes (the planner's estimate), split over the nodes, over the
    plan's checkpoint interval: every node writes its own ranks' shards at the same time, and
    the background write must finish before the next save begins. A plan without checkpoint
    advice (written by hand) gets the advice `mscale plan` would give it (the step time, when
    the plan has no estimate, only rounds the interval)."""
    params = plan.model.num_parameters()
    total = params * CHECKPOINT_BYTES_PER_PARAM
    nodes = plan.cluster.num_nodes
    advice, source = plan.checkpoint, "the plan's checkpoint interval"
    if advice is None:
        step_s = float(plan.estimate.get("step_time_s") or 1.0)
        advice, _ = advise(params, plan.cluster.world_size, nodes, step_s,
                           run_steps=plan.training.steps)
        source = "the planner's checkpoint interval for this plan"
    return StorageNeed(node_bytes=total / nodes, total_bytes=total,
                       target_s=max(advice.interval_s, 1e-3), source=source)


def check_storage_url(url: str) -> None:
    """Raise MscaleError naming ``url`` unless a file can be written, read and removed there.

    Bad input, exit 3, before any rank starts measuring: an unknown protocol, a path under a
    regular file, no permission, a host that does not answer. What it creates is removed.
    """
    check_output(url, kind="dir", what=WHAT)
    fs, path = fs_and_path(url)
    try:
        with _probe_dir(fs, path) as probe:
            fs.pipe_file(f"{probe}/reach", b"preflight")
            fs.cat_file(f"{probe}/reach")
    except MscaleError:
        raise
    except Exception as e:  # noqa: BLE001 - every fsspec backend raises its own types
        raise MscaleError(f"the checkpoint storage cannot be reached ({type(e).__name__}: "
                          f"{_first_line(e)})", file=url,
                          fix="check the URL, the credentials and that the storage is mounted "
                              "or reachable from this node") from None


def storage_checks(url: str, plan: Plan, node: str, *, level: str = "quick",
                   probe_bytes: int | None = None,
                   fs: fsspec.AbstractFileSystem | None = None,
                   timeout_s: float | None = None) -> list[CheckResult]:
    """Write + fsync, then read back, ``probe_bytes`` at ``url``; judge both against the plan's
    need; report free space. ``fs`` replaces the filesystem resolved from ``url`` (tests pass a
    throttled one). A store that fails midway (full, gone) is CRITICAL for this node. With the
    job's ``timeout_s``, the write and the read each stop after `BUDGET_SHARE` of it."""
    if fs is None:
        fs, path = fs_and_path(url)
    else:
        path = fs._strip_protocol(url)
    need = storage_need(plan)
    size = probe_bytes or PROBE_BYTES.get(level, PROBE_BYTES["quick"])
    budget = None if timeout_s is None else BUDGET_SHARE * timeout_s
    try:
        with _probe_dir(fs, path) as probe:
            write_s, wrote = _timed_write(fs, f"{probe}/probe.bin", size, budget)
            read_s, got = _timed_read(fs, f"{probe}/probe.bin", budget)
    except Exception as e:  # noqa: BLE001 - a failing store is this node's finding, not a crash
        return [_result("storage_write", node, url, None, need, "CRITICAL",
                        f"writing {size} bytes failed ({type(e).__name__}: {_first_line(e)})")]
    if got != wrote and (budget is None or read_s < budget):
        return [_result("storage_read", node, url, None, need, "CRITICAL",
                        f"read back {got} of the {wrote} bytes written")]
    out = [_judged("storage_write", node, url, wrote / write_s, need, "write + fsync",
                   _short(wrote, size, budget)),
           _judged("storage_read", node, url, got / read_s, need, "read back",
                   _short(got, wrote, budget))]
    free = free_space(fs, path, need, node, url)
    return out + ([free] if free is not None else [])


STORAGE_CHECKS = ("storage_write", "storage_read", "free_space")


def blame_storage(results: list[CheckResult]) -> None:
    """Take the blame for a failed storage check off the nodes, in place, when it failed on half
    of the nodes that ran it or more: the checkpoint store is shared, and a store too slow or
    too full for the plan is the same store from every node, so excluding nodes for it would
    only exclude the whole job (recover would then find no layout to relaunch). A check that
    fails on fewer nodes than that stays on them: their mount, their link to the store. The
    result keeps its ``node`` (where it was measured); ``evidence.blamed`` False says that it
    puts no node in ``bad_nodes`` (report.py: `finish`)."""
    for check in STORAGE_CHECKS:
        ran = [r for r in results if r.check == check and r.entity_kind == "storage"]
        failed = [r for r in ran if r.status == "CRITICAL"]
        if not failed or 2 * len(failed) < len(ran):
            continue
        for r in failed:
            r.evidence = {**r.evidence, "blamed": False, "failed_on": len(failed),
                          "ran_on": len(ran)}
            r.message += (f"; it fails on {len(failed)} of {len(ran)} node(s): the storage, "
                          "not this node, so no node is excluded for it")


def free_space(fs: fsspec.AbstractFileSystem, path: str, need: StorageNeed, node: str,
               url: str) -> CheckResult | None:
    """Room for one more checkpoint (a new save is written in full before the oldest kept one is
    deleted): CRITICAL below one, WARNING below two. Object stores have no visible capacity (no
    result); other remote filesystems do not say (UNKNOWN)."""
    if _is_object_store(fs):
        return None
    common = dict(check="free_space", entity_kind="storage", entity=url, node=node, unit="GB",
                  expected=f">= {need.total_bytes / 1e9:.3g} GB (one checkpoint)")
    if not isinstance(fs, LocalFileSystem):
        return CheckResult(**common, status="UNKNOWN",
                           message=f"{type(fs).__name__} does not report free space")
    at = path
    while not os.path.exists(at):
        at = os.path.dirname(at) or "/"
    free = shutil.disk_usage(at).free
    ratio = free / max(need.total_bytes, 1.0)
    status: Status = "CRITICAL" if ratio < 1 else "WARNING" if ratio < 2 else "OK"
    msg = {"CRITICAL": "not enough room for one checkpoint: free space or move the checkpoints",
           "WARNING": "room for only one more checkpoint",
           "OK": f"room for {ratio:.0f} checkpoints" if ratio < 1000
           else "room for over 1000 checkpoints"}[status]
    return CheckResult(**common, value=round(free / 1e9, 3), status=status, message=msg,
                       evidence={"checkpoint_bytes": need.total_bytes, "free_bytes": free})


def _short(moved: int, size: int, budget: float | None) -> str:
    """The note of a probe stopped at its time budget, or nothing."""
    if moved >= size or budget is None:
        return ""
    return (f" (cut short after {budget:.3g} s, {BUDGET_SHARE:g} of --timeout: "
            f"{moved} of {size} bytes)")


def _judged(check: str, node: str, url: str, bps: float, need: StorageNeed,
            what: str, note: str = "") -> CheckResult:
    ratio = bps / need.bytes_per_s
    status: Status = "CRITICAL" if ratio < 1 else "WARNING" if ratio < HEADROOM else "OK"
    secs = need.node_bytes / bps
    msg = (f"{what} at {bps / 1e6:.1f} MB/s{note}: this node's share of a checkpoint "
           f"({need.node_bytes / 1e9:.3g} GB) takes {secs:.3g} s against {need.target_s:.3g} s "
           f"({need.source})")
    if status == "CRITICAL":
        msg += "; the checkpoint cannot keep up: use faster storage or exclude this node"
    return _result(check, node, url, bps, need, status, msg)


def _result(check: str, node: str, url: str, bps: float | None, need: StorageNeed,
            status: Status, message: str) -> CheckResult:
    return CheckResult(check=check, entity_kind="storage", entity=url, node=node,
                       value=None if bps is None else round(bps / 1e6, 3), unit="MB/s",
                       expected=f">= {need.bytes_per_s / 1e6:.3g} MB/s "
                                f"(WARNING below {HEADROOM:g}×)",
                       status=status, message=message,
                       evidence={"node_checkpoint_bytes": need.node_bytes,
                                 "target_s": need.target_s, "target_source": need.source})


@contextlib.contextmanager
def _probe_dir(fs: fsspec.AbstractFileSystem, path: str):
    """A fresh directory under ``path``, removed on the way out, and then each parent the probe
    had to create as long as it is empty: other nodes may be probing in the same parents at the
    same time, so nothing but this probe is ever removed recursively."""
    top = probe = f"{path.rstrip('/')}/.preflight-{uuid.uuid4().hex[:12]}"
    while (parent := os.path.dirname(top)) not in ("", "/", top) and not fs.exists(parent):
        top = parent
    fs.makedirs(probe, exist_ok=True)
    try:
        yield probe
    finally:
        with contextlib.suppress(Exception):
            fs.rm(probe, recursive=True)
        created = probe
        while created != top:
            created = os.path.dirname(created)
            try:
                fs.rmdir(created)  # refuses a directory another probe still uses
            except Exception:  # noqa: BLE001 - not empty (or gone): leave it and stop
                break


def _timed_write(fs: fsspec.AbstractFileSystem, path: str, size: int,
                 budget_s: float | None = None) -> tuple[float, int]:
    """Seconds to write ``size`` bytes (fewer once ``budget_s`` has passed: at least one
    block) and make them durable, and the bytes written: fsync locally (then drop the file's
    clean pages from the page cache so the read is not a memory copy), close (the upload)
    elsewhere."""
    block = os.urandom(min(BLOCK_BYTES, size))
    t0 = time.perf_counter()
    with fs.open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
            if budget_s is None:
                continue
            if (size - left) % SYNC_BYTES == 0:
                # a local mount's writes land in the page cache and one fsync at the end moves
                # them all: synced every SYNC_BYTES, the budget bounds that too (a sync per
                # 8 MiB block would measure a parallel filesystem below its streaming rate)
                _sync(f)
            if time.perf_counter() - t0 > budget_s:
                break
        fd = _sync(f)
    elapsed = time.perf_counter() - t0
    if fd is not None and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError), open(path, "rb") as g:
            os.posix_fadvise(g.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return max(elapsed, 1e-9), size - left


def _timed_read(fs: fsspec.AbstractFileSystem, path: str,
                budget_s: float | None = None) -> tuple[float, int]:
    """Seconds to read the file back (its start only once ``budget_s`` has passed), and the
    bytes read."""
    t0 = time.perf_counter()
    got = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(BLOCK_BYTES):
            got += len(chunk)
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                break
    return max(time.perf_counter() - t0, 1e-9), got


def _sync(f) -> int | None:
    """Flush ``f`` and fsync it where it is a local file; its descriptor, or None."""
    f.flush()
    fd = _fileno(f)
    if fd is not None:
        os.fsync(fd)
    return fd


def _fileno(f) -> int | None:
    try:
        return f.fileno()
    except (AttributeError, OSError, ValueError, NotImplementedError):
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
