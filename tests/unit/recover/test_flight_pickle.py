"""torch's own flight-recorder dump (a pickle, what NCCL's watchdog writes on a timeout) is
read as plain data: the dump of a real gloo group is, and a pickle naming a function is not."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest

from mscale.recover.diagnose import read
from mscale.recover.diagnose.evidence import collect
from tests.unit.recover.diag_runs import Run

DUMP = textwrap.dedent("""
    import os, sys
    os.environ["TORCH_FR_BUFFER_SIZE"] = "64"
    import torch, torch.distributed as dist
    from torch._C import _distributed_c10d as c10d
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    open(sys.argv[1], "wb").write(c10d._dump_fr_trace(True, False))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def torch_dump(tmp_path_factory) -> bytes:
    """What torch's pickler writes for a flight record (the same writer NCCL's dump uses)."""
    d = tmp_path_factory.mktemp("fr")
    out = d / "dump"
    subprocess.run([sys.executable, "-c", DUMP, str(out), str(d / "store")], check=True,
                   timeout=120)
    return out.read_bytes()


def info(path) -> read.FileInfo:
    return read.FileInfo(url=str(path), source=path.name, size=path.stat().st_size, mtime=None)


def test_torchs_dump_is_plain_data_and_is_read(torch_dump, tmp_path):
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(torch_dump)
    doc = read.read_plain_pickle(info(path), read.FLIGHT_CAP_BYTES)
    assert doc == pickle.loads(torch_dump)  # the same data as an unrestricted load
    ops = [e["profiling_name"] for e in doc["entries"]]
    assert ops.count("gloo:all_reduce") == 2 and "pg_config" in doc
    json.dumps(doc)  # plain data all through


def test_a_pickle_naming_anything_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    evil = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    path = tmp_path / "nccl_trace_rank_1"
    path.write_bytes(evil)
    with pytest.raises(read.Problem, match="it names os.system: only plain data is read"):
        read.read_plain_pickle(info(path), read.FLIGHT_CAP_BYTES)
    assert not marker.exists()
    path.write_bytes(b"\x80\x02}q\x00(X")  # cut short
    with pytest.raises(read.Problem, match="not read: pickle data was truncated"):
        read.read_plain_pickle(info(path), read.FLIGHT_CAP_BYTES)
    with pytest.raises(read.Problem, match="over the 4-byte cap"):
        read.read_plain_pickle(info(path), 4)


def test_a_dump_named_for_another_attempt_is_not_this_ones(torch_dump, tmp_path):
    """train points torch's dump at logs/nccl_trace_attempt<K>_rank_<N> (distributed/flight.py
    `point_torch_dump`): a relaunch within seconds must not read the attempt before it's."""
    run = Run(tmp_path / "run")
    run.start(0.0, attempt=1)
    run.start(14.0, attempt=2)
    run.file("logs/nccl_trace_attempt1_rank_3", torch_dump, t=15)
    run.file("logs/nccl_trace_attempt2_rank_0", torch_dump, t=30)
    ev = collect(run.path)
    assert [(f.source, r, doc["version"]) for f, r, doc in ev.flight] == [
        ("logs/nccl_trace_attempt2_rank_0", 0, pickle.loads(torch_dump)["version"])]
