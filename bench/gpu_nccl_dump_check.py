"""GPU check: where torch's flight-recorder dump goes when NCCL's watchdog ends a timed-out job.

A child process makes a world-1 NCCL group with a 5 s timeout, as train does (flight.enable
before the group, `flight.point_torch_dump` after it, as train/session.py calls it once the
attempt is known), then enqueues an all-reduce behind a GPU kernel that spins for 60 s: the
collective cannot finish, the watchdog times it out, dumps, and tears the process down (what a
hung peer does to a real job). The parent then looks for the dump: under the run's
``logs/nccl_trace_attempt1_rank_0`` (torch read the path when it wrote), or under torch's
default ``/tmp/nccl_trace_rank_0`` (it read it when the group was made: train must point it
before). Either way the dump must name the all-reduce: its strings are listed from the pickle's
opcodes (`pickletools.genops`), which reads the stream without loading it: nothing is
unpickled, as recover never unpickles. Prints PASS/FAIL lines; exit 1 on FAIL. Needs one GPU.

    python3 bench/gpu_nccl_dump_check.py
"""

from __future__ import annotations

import glob
import os
import pickletools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DUMP = "/tmp/nccl_trace_rank_0"
CHILD = """
import sys, torch, torch.distributed as dist
from mscale.distributed import flight
from mscale.distributed.init import init_distributed
from mscale.distributed.spawn import free_port
from mscale.topology.env import LaunchEnv
init_distributed(LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                           master_addr="127.0.0.1", master_port=free_port(), launcher="bench",
                           hostname="localhost"), timeout_s=5)
x = torch.ones(1024, device="cuda")
dist.all_reduce(x); torch.cuda.synchronize()  # the communicator exists: a real job's state
print("prefix", flight.point_torch_dump(sys.argv[1], 1), flush=True)
torch.cuda._sleep(int(60 * 2e9))  # ~60 s of spinning at up to 2 GHz: the stream is busy
dist.all_reduce(x)  # behind it: never finishes within the 5 s timeout
x.cpu()
print("the all-reduce finished: no timeout fired", flush=True)
"""


def strings_in(path: str) -> list[str]:
    """The text values a pickle holds, read from its opcodes; nothing is loaded or run."""
    with open(path, "rb") as f:
        return [arg for op, arg, _ in pickletools.genops(f) if isinstance(arg, str)
                and "UNICODE" in op.name]


def main() -> int:
    logs = tempfile.mkdtemp(prefix="nccl-dump-")
    if os.path.exists(DEFAULT_DUMP):
        os.remove(DEFAULT_DUMP)
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, "-c", CHILD, logs], capture_output=True, text=True,
                           timeout=150)
    took = time.monotonic() - t0
    tail = (child.stdout + child.stderr).strip().splitlines()[-3:]
    print(f"INFO: child exit {child.returncode} after {took:.0f} s; last lines: {tail}")
    ours = sorted(glob.glob(os.path.join(logs, "nccl_trace_attempt1_rank_*")))
    where = ours[0] if ours else (DEFAULT_DUMP if os.path.exists(DEFAULT_DUMP) else None)
    if where is None:
        print("FAIL: no dump, neither under the run's logs/ nor at " + DEFAULT_DUMP)
        return 1
    print(f"INFO: the dump is at {where} ({os.path.getsize(where)} bytes)")
    try:
        texts = strings_in(where)
    except Exception as e:  # noqa: BLE001 - a damaged dump is this check's failure, said
        print(f"FAIL: the dump is no readable pickle stream ({type(e).__name__}: {e})")
        return 1
    names = sorted({t for t in texts if "all_reduce" in t or "allreduce" in t})
    print(f"INFO: {len(texts)} strings; collectives named: {names}; states: "
          f"{sorted({t for t in texts if t in ('scheduled', 'started', 'completed')})}")
    ok = bool(ours) and bool(names)
    print(f"{'PASS' if ok else 'FAIL'}: torch's dump on an NCCL timeout "
          + ("is under the run's logs/ with its attempt" if ours else
             f"went to {DEFAULT_DUMP}: torch read the path when the group was made")
          + (", naming the all-reduce" if names else ", but names no all-reduce"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
