"""The slowlink shim paces exactly the socket writes of the selected process, from the moment set.

The cases through a socketpair use ``scope="all"`` (every socket write): a Unix socket never
leaves the node, so the default scope paces none of it (`test_node_scope_*`).

Each case runs a fresh Python with the shim preloaded and measures inside it, since the shim acts
on the whole process. Paced cases must take at least the time their bytes cost at the link's
rate (a hard floor: pacing only ever adds time); unpaced ones must stay well under that cost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import slowlink

pytestmark = pytest.mark.timing  # unpaced sends must stay under a wall-clock ceiling

BPS = 10_000_000
NBYTES = 2_000_000
COST_S = NBYTES / BPS                # 0.2 s: what NBYTES cost on the slow link
PACED_FLOOR_S = 0.9 * COST_S         # pacing sleeps the full cost first; 10% for clock slack
UNPACED_CEILING_S = 0.5 * COST_S     # an unpaced 2 MB local write takes milliseconds
SETTLE_S = 0.2                       # longer than the shim trusts its cached env / onset check

# Variables a caller may have set that would select, or unselect, the process on their own.
_INHERITED = ("RANK", "SLOWLINK_MATCH", "SLOWLINK_BPS", "SLOWLINK_ONSET_FILE", "SLOWLINK_DEBUG",
              "SLOWLINK_SCOPE", "MSCALE_LAUNCHER", "GROUP_RANK")

# Shared by the socket cases: push bytes through a socketpair that a thread drains, check that
# every byte arrived unchanged, print "<name> <seconds>". Non-blocking (as gloo's sockets are),
# it sends the way event loops do: wait until writable, send what the kernel takes, repeat.
_SENDER = f"""
import os, select, socket, threading, time

NBYTES = {NBYTES}

def send_blocking(sock, payload):
    sock.sendall(payload)

def send_nonblocking(sock, payload):
    sock.setblocking(False)
    view = memoryview(payload)
    while view:
        select.select([], [sock], [], 30)
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            pass

def timed_send(name, nbytes=NBYTES, send=send_blocking):
    ours, theirs = socket.socketpair()
    received = bytearray()
    def drain():
        while chunk := theirs.recv(1 << 20):
            received.extend(chunk)
    reader = threading.Thread(target=drain)
    reader.start()
    payload = os.urandom(nbytes)
    start = time.perf_counter()
    send(ours, payload)
    seconds = time.perf_counter() - start
    ours.close()
    reader.join()
    theirs.close()
    assert received == payload, "the shim changed what was sent"
    print(name, seconds, flush=True)
    return seconds
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slowlink.build_for_test(tmp_path_factory.mktemp("slowlink"))


def _child_env(shim_env: dict[str, str], **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    return {**base, **shim_env, **extra}


def _run(code: str, env: dict[str, str], timeout_s: float = 60) -> dict[str, float]:
    """Run `code` after the sender helpers; return the "<name> <seconds>" lines it printed."""
    done = subprocess.run([sys.executable, "-c", _SENDER + code], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    timings = dict(line.split() for line in done.stdout.splitlines())
    return {name: float(seconds) for name, seconds in timings.items()}


def test_selected_process_sends_at_the_link_rate_and_others_at_full_speed(shim: Path) -> None:
    shim_env = slowlink.env(shim, "RANK=5", BPS, scope="all")
    selected = _run("timed_send('send')", _child_env(shim_env, RANK="5"))["send"]
    other = _run("timed_send('send')", _child_env(shim_env, RANK="4"))["send"]
    assert selected >= PACED_FLOOR_S, f"RANK=5 is selected: 2 MB at 10 MB/s took {selected:.3f}s"
    # against the paced send measured here, not a fixed time: a loaded machine slows both
    assert other < selected / 2, \
        f"RANK=4 is not selected, yet 2 MB took {other:.3f}s (paced: {selected:.3f}s)"


def test_threads_share_one_link(shim: Path) -> None:
    """Two threads sending half each take as long as one sending all: the rate is per process."""
    code = """
halves = [threading.Thread(target=timed_send, args=(name, NBYTES // 2)) for name in "ab"]
start = time.perf_counter()
for half in halves:
    half.start()
for half in halves:
    half.join()
print("both", time.perf_counter() - start)
"""
    timings = _run(code, _child_env(slowlink.env(shim, "RANK=5", BPS, scope="all"), RANK="5"))
    assert timings["both"] >= PACED_FLOOR_S, timings


def test_non_blocking_sends_are_paced_to_the_rate_not_below_it(shim: Path) -> None:
    """A non-blocking send is charged for what the kernel took, not for what was asked.

    The kernel takes ~200 KB of each 2 MB request; charging the request would send at a tenth
    of the rate (2 s). The upper bound sits halfway to that, so a busy machine cannot reach it.
    """
    code = "timed_send('send', send=send_nonblocking)"
    shim_env = slowlink.env(shim, "RANK=5", BPS, scope="all")
    seconds = _run(code, _child_env(shim_env, RANK="5"))["send"]
    assert PACED_FLOOR_S <= seconds < 5 * COST_S


def test_files_and_pipes_are_never_paced(shim: Path, tmp_path: Path) -> None:
    """Logs and console pipes of a slowed rank stay fast; its sockets in the same run do not."""
    code = f"""
payload = os.urandom(NBYTES)
start = time.perf_counter()
with open({str(tmp_path / "log")!r}, "wb", buffering=0) as log:
    log.write(payload)
print("file", time.perf_counter() - start)

read_end, write_end = os.pipe()
def drain_pipe():
    while os.read(read_end, 1 << 20):
        pass
reader = threading.Thread(target=drain_pipe)
reader.start()
start = time.perf_counter()
view = memoryview(payload)
while view:
    view = view[os.write(write_end, view):]
print("pipe", time.perf_counter() - start)
os.close(write_end)
reader.join()
timed_send("socket")
"""
    timings = _run(code, _child_env(slowlink.env(shim, "RANK=5", BPS, scope="all"), RANK="5"))
    assert timings["file"] < UNPACED_CEILING_S, timings
    assert timings["pipe"] < UNPACED_CEILING_S, timings
    assert timings["socket"] >= PACED_FLOOR_S, timings
    assert (tmp_path / "log").stat().st_size == NBYTES


def test_pacing_starts_when_the_onset_file_appears(shim: Path, tmp_path: Path) -> None:
    onset = tmp_path / "onset"
    code = f"""
timed_send("before")
open({str(onset)!r}, "w").close()
time.sleep({SETTLE_S})
timed_send("after")
"""
    shim_env = slowlink.env(shim, "RANK=5", BPS, onset, scope="all")
    timings = _run(code, _child_env(shim_env, RANK="5"))
    assert timings["before"] < UNPACED_CEILING_S, timings
    assert timings["after"] >= PACED_FLOOR_S, timings


def test_selection_follows_env_set_after_start(shim: Path) -> None:
    """Launchers set RANK through os.environ once the process runs; the shim must see it."""
    code = f"""
timed_send("no_rank")
os.environ["RANK"] = "5"
time.sleep({SETTLE_S})
timed_send("rank_5")
del os.environ["RANK"]
time.sleep({SETTLE_S})
timed_send("rank_removed")
"""
    timings = _run(code, _child_env(slowlink.env(shim, "RANK=5", BPS, scope="all")))
    assert timings["no_rank"] < UNPACED_CEILING_S, timings
    assert timings["rank_5"] >= PACED_FLOOR_S, timings
    assert timings["rank_removed"] < UNPACED_CEILING_S, timings


# One rank of a real two-process gloo group. Rank 1 starts without RANK, so it is not selected;
# then each rank sets RANK the way a launcher does, and SLOWLINK_MATCH=RANK=1 selects rank 1.
# Both phases time ALL_REDUCES all_reduces after a warm-up and a barrier.
TENSOR_BYTES = 4 << 20
ALL_REDUCES = 3
_GLOO_RANK = f"""
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
timeout = timedelta(seconds=30)
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank,
                        world_size=2, timeout=timeout)
payload = torch.ones({TENSOR_BYTES} // 4)

def timed_all_reduces():
    dist.all_reduce(payload, async_op=True).wait(timeout)
    dist.barrier(async_op=True).wait(timeout)
    start = time.perf_counter()
    for _ in range({ALL_REDUCES}):
        dist.all_reduce(payload, async_op=True).wait(timeout)
    return time.perf_counter() - start

print("phase unselected", timed_all_reduces(), flush=True)
os.environ["RANK"] = str(rank)
time.sleep({SETTLE_S})
print("phase selected", timed_all_reduces(), flush=True)
dist.destroy_process_group()
"""


def _gloo_phases(env: dict[str, str], per_rank: list[dict[str, str]]) -> tuple[float, float]:
    """Run the two gloo ranks (``per_rank``: each one's extra variables); the phases' times."""
    from mscale.distributed.spawn import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", _GLOO_RANK, str(rank), port],
                              env={**env, **per_rank[rank]}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for proc in ranks:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in ranks] == [0, 0], "\n".join(outputs)
    phases = [dict(line.split()[1:] for line in out.splitlines() if line.startswith("phase "))
              for out in outputs]
    # A collective ends when its slowest rank does.
    return (max(float(phase["unselected"]) for phase in phases),
            max(float(phase["selected"]) for phase in phases))


# Whatever the algorithm, rank 0 must receive rank 1's whole tensor once per all_reduce.
GLOO_FLOOR_S = 0.75 * ALL_REDUCES * TENSOR_BYTES / BPS


@pytest.mark.dist
def test_one_slow_rank_slows_every_gloo_all_reduce(shim: Path) -> None:
    env = _child_env(slowlink.env(shim, "RANK=1", BPS, scope="all"), MASTER_ADDR="127.0.0.1",
                     OMP_NUM_THREADS="1")
    unselected, selected = _gloo_phases(env, [{}, {}])
    assert selected >= GLOO_FLOOR_S, \
        f"rank 1 at 10 MB/s: {selected:.3f}s, expected >= {GLOO_FLOOR_S:.2f}s"
    assert selected >= 3 * unselected, f"selected {selected:.3f}s vs unselected {unselected:.3f}s"


@pytest.mark.dist
@pytest.mark.parametrize("nodes", [["0", "1"], ["0", "0"]], ids=["two_nodes", "one_node"])
def test_node_scope_paces_only_what_leaves_the_pretend_node(shim: Path, nodes) -> None:
    """As ``--local`` runs them (MSCALE_LAUNCHER=local, GROUP_RANK the pretend node), the two
    ranks get their node's loopback address: on two nodes rank 1's sends to rank 0 leave its
    node and are paced; on one node they stay inside it, as NVLink traffic would, and are not.
    Before, every socket write of rank 1 was paced, its own node's included."""
    env = _child_env(slowlink.env(shim, "RANK=1", BPS), MASTER_ADDR="127.0.0.1",
                     OMP_NUM_THREADS="1", MSCALE_LAUNCHER="local")
    unselected, selected = _gloo_phases(env, [{"GROUP_RANK": n} for n in nodes])
    if nodes[0] != nodes[1]:
        assert selected >= GLOO_FLOOR_S and selected >= 3 * unselected, (selected, unselected)
    else:  # against the floor the paced case must pass: unpaced it takes milliseconds
        assert selected < GLOO_FLOOR_S / 3, (selected, unselected)


def test_node_scope_never_paces_a_unix_socket(shim: Path) -> None:
    """A Unix socket (shared memory, a local helper) never leaves the node."""
    timings = _run("timed_send('send')", _child_env(slowlink.env(shim, "RANK=5", BPS), RANK="5"))
    assert timings["send"] < UNPACED_CEILING_S, timings
