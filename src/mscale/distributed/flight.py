"""torch's flight recorder: on for every job, dumped as JSON by a rank that fails.

The flight recorder keeps, per process, a ring of the last collectives each process group
enqueued (group, sequence number, op, sizes, creation time, timeout) and each group's last
enqueued and completed sequence numbers. After a hang, comparing the ranks' records names the
rank that never joined the collective its peers wait in (MegaScale §5's hang localisation, and
what torchtitan turns on with ``comm.trace_buf_size``); recover does that comparison
(`mscale.recover.diagnose.hang`). torch records for gloo as well as NCCL (gloo since torch 2.7),
so the CPU path is tested end to end.

A failing rank (`train/failure.py`) writes its record as JSON to
``RUN/logs/flight_recorder_rank<N>.json``: torch's JSON dump with two changes (below). Under
NCCL the process may not get that far: the watchdog that finds a collective past its timeout
tears the process down. Torch's own dump on timeout is then the record, so train turns it on
(``TORCH_NCCL_DUMP_ON_TIMEOUT``) and points it into the run (`point_torch_dump`:
``RUN/logs/nccl_trace_attempt<K>_rank_<N>``), where it stays with the run for torch's own
analyser (``torchfrtrace``); it is a pickle, so recover names it as evidence of its attempt and
never unpickles it. Whether torch takes the file name set after its process groups exist is
what the GPU check ``nccl-dump`` shows (bench/gpu_checks.py); until then a dump may still go to
torch's default, ``/tmp/nccl_trace_rank_<N>`` on each node.

- The attempt it belongs to is added (``mscale_attempt``), and the member ranks of each of its
  groups under ``mscale_groups`` (torch's own
  ``pg_config`` lists none for gloo): recover needs them to name a member that left no record at
  all (a rank killed while it was stopped).
- The entries are cut to the newest of each group and the newest `KEEP_NEWEST` overall: all that
  the comparison reads, and what a person reads first. Whole, a record is ~0.5 KB an entry
  (~1 MB a rank at `DEFAULT_ENTRIES`), which after a job-wide hang at 12,288 ranks is 13 GB of
  dumps on the shared filesystem.

The ``pg_id`` of torch's records is numbered per process (the order this rank made its groups),
not per job: groups are compared by name, which every member gives the same.
"""

from __future__ import annotations

import json
import os
import sys

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
LEGACY_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
"""The name torch read before 2.7 (NCCL only); still read when the new one is unset."""
DEFAULT_ENTRIES = 2000
"""Collectives kept per process: a step of the deepest plan enqueues a few hundred (one per
bucket, per pipeline transfer, per TP exchange), so a hang's record reaches back several steps.
Entries are small (no tensors); 0 turns the recorder off."""
KEEP_NEWEST = 64
"""Entries kept overall in a dump (beside each group's newest)."""
GROUPS_KEY = "mscale_groups"
"""The added field: process group name -> the global ranks in it (the groups this rank is in)."""
ATTEMPT_KEY = "mscale_attempt"
"""The added field: the run's attempt this process belongs to (`note_attempt`), so that recover
reads a dump for the attempt that wrote it, and never an earlier attempt's left in ``logs/``
(a file's time cannot tell them apart when a relaunch follows within seconds)."""
_attempt: list[int] = []
NCCL_KEY = "mscale_nccl"
"""On a GPU: what torch's NCCL dump returns (``_dump_nccl_trace_json``), trimmed alike, beside
the main record (``_dump_fr_trace_json``: on this CPU build, gloo's). Kept for people and
tools; recover's comparison reads the main record only so far: NCCL enqueues ahead of the
device, so where a rank was blocked is the oldest collective not completed, not the newest
enqueued. Which record holds which collectives on a GPU is what bench/gpu_checks.py
``flight`` reports; not yet run on one."""


DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
"""NCCL's watchdog dumps the recorder before it tears a timed-out process down (read when a
process group is made)."""
DUMP_FILE_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where that dump goes: a prefix the rank is appended to (the second is the name torch read
before the recorder served gloo too; both are set, an operator's either stands)."""


def note_attempt(number: int) -> None:
    """The attempt this process trains in, once every rank knows it (train/session.py)."""
    _attempt[:] = [number]


def enable(environ: dict | None = None) -> None:
    """Turn the recorder on for the process groups created after this call, and NCCL's dump on
    a timeout, unless the operator set them (any value, 0 included: theirs stands)."""
    env = os.environ if environ is None else environ
    if BUFFER_ENV not in env and LEGACY_BUFFER_ENV not in env:
        env[BUFFER_ENV] = str(DEFAULT_ENTRIES)
    env.setdefault(DUMP_ON_TIMEOUT_ENV, "1")


def torch_dump_prefix(logs_dir: str, attempt: int) -> str:
    """The path torch's own dump takes, its rank appended: recover reads it for that attempt
    only (recover/diagnose/evidence.py ``_FLIGHT``)."""
    return os.path.join(logs_dir, f"nccl_trace_attempt{attempt}_rank_")


def point_torch_dump(logs_dir: str, attempt: int, environ: dict | None = None) -> str | None:
    """Send torch's dump on an NCCL timeout to the run's ``logs/`` under this attempt's name,
    unless the operator chose a place, or the run directory is not a local path (torch writes
    with a plain file stream). Returns the prefix set, or None."""
    env = os.environ if environ is None else environ
    logs_dir = logs_dir.removeprefix("file://")
    if any(name in env for name in DUMP_FILE_ENVS) or "://" in logs_dir:
        return None
    prefix = torch_dump_prefix(os.path.abspath(logs_dir), attempt)
    for name in DUMP_FILE_ENVS:
        env[name] = prefix
    return prefix


def enabled(environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    size = env.get(BUFFER_ENV, env.get(LEGACY_BUFFER_ENV, "0"))
    return size.strip().isdigit() and int(size) > 0


def dump_name(rank: int) -> str:
    """The file name under ``RUN/logs/`` (recover's reader matches ``flight_recorder_rank<N>``)."""
    return f"flight_recorder_rank{rank}.json"


def record() -> dict | None:
    """This process's flight record with its groups' members, or None when there is none (the
    recorder is off, torch has no JSON dump, no process group was made)."""
    import torch.distributed as dist

    if not enabled() or not dist.is_available() or not dist.is_initialized():
        return None
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json",
                                                                 None)
    if dump is None:
        return None
    doc = json.loads(dump(True, False))
    doc["entries"] = trimmed(doc.get("entries") or [])
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    if nccl is not None and dump is not nccl and _cuda_in_use():
        doc[NCCL_KEY] = json.loads(nccl(True, False))
        doc[NCCL_KEY]["entries"] = trimmed(doc[NCCL_KEY].get("entries") or [])
    doc[GROUPS_KEY] = group_members()
    if _attempt:
        doc[ATTEMPT_KEY] = _attempt[0]
    return doc


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def trimmed(entries: list[dict]) -> list[dict]:
    """The newest entry of each process group, and the newest `KEEP_NEWEST`, in record order."""
    keep = set(range(max(0, len(entries) - KEEP_NEWEST), len(entries)))
    newest: dict[str, int] = {}
    for i, e in enumerate(entries):
        group = (e.get("process_group") or [None])[0]
        newest[f"{group}/{bool(e.get('is_p2p'))}"] = i
    return [entries[i] for i in sorted(keep | set(newest.values()))]


def group_members() -> dict[str, list[int]]:
    """Every process group this rank is in, by the name the flight record uses, with its members'
    global ranks."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return {world.pg_names[pg]: sorted(ranks) for pg, ranks in world.pg_group_ranks.items()
            if pg in world.pg_names}


def write_dump(logs_dir: str, rank: int) -> str | None:
    """Write this rank's flight record beside its error file; returns the path, or None when
    there is nothing to write or it could not be written (said on stderr: the failure being
    reported must not be replaced by this one)."""
    from mscale.runs.atomic import write_text_atomic

    try:
        doc = record()
        if doc is None:
            return None
        path = f"{logs_dir.rstrip('/')}/{dump_name(rank)}"
        write_text_atomic(path, json.dumps(doc) + "\n")
        return path
    except Exception as e:  # noqa: BLE001 - evidence for later; the failure itself comes first
        sys.stderr.write(f"rank {rank}: the flight recorder could not be dumped "
                         f"({type(e).__name__}: {e})\n")
        return None
