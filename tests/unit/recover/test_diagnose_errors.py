"""diagnose(): what failed, read from its own words in the writers' real shapes: out of memory,
GPU faults, storage (a full disk, I/O errors, a data store down, a read-only run directory), user
code and bad input, network errors, torchelastic's error file."""

from __future__ import annotations

import json

import pytest

from mscale.errors import MscaleError
from mscale.recover.diagnose import diagnose
from tests.unit.recover.diag_runs import GLOO_RESET, Run, run, started  # noqa: F401 - a fixture


def test_cuda_oom_in_an_error_file(run):
    rid = started(run)
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
           "total capacity of 79.11 GiB of which 1.2 GiB is free.")
    run.error_file(1, 5, "crash", msg)
    run.error_file(0, 5.2, "network", GLOO_RESET)
    run.launcher_stop(6, rid, 1, "exited with code 3", "crash", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("software", "oom", False)
    assert d.suspect_ranks == [1] and d.suspect_nodes == ["node1"]


def test_the_oom_killer_in_slurm_output(run):
    run.start(0.0, run_id="slurm-8", launcher="slurm")
    run.file("slurm-8.out", "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=8.0. "
             "Some of your processes may have been killed by the cgroup out-of-memory handler.\n"
             "srun: error: node2: task 2: Out Of Memory\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("software", "oom")


@pytest.mark.parametrize("line,cls", [
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", "gpu"),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, An uncorrectable double bit error (DBE)", "gpu"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "gpu"),
    ("RuntimeError: CUDA error: unspecified launch failure", "gpu"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "gpu"),
    ("NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, Graphics Exception", "software"),
])
def test_gpu_faults_blame_the_rank_that_saw_them(run, line, cls):
    rid = started(run)
    run.log(3, f"step 3\n{line}\n", t=5)
    run.error_file(0, 5.5, "network", GLOO_RESET)
    run.launcher_stop(6, rid, 3, "exited with code 3", "no error file", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == (cls, "crash", False)
    assert d.suspect_ranks == [3] and d.suspect_nodes == ["node2"]
    assert d.evidence[0].text == line.strip() or line.split(":")[0] in d.evidence[0].text


def test_a_full_disk(run):
    rid = started(run)
    run.error_file(0, 5, "disk_full", "OSError: [Errno 28] No space left on device: "
                   "'/runs/r1/metrics.jsonl'")
    run.launcher_stop(6, rid, 0, "exited with code 3", "disk_full", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("storage", "disk_full", False)


def test_a_checkpoint_that_hit_enospc_then_a_stop(run):
    rid = started(run)
    run.event("checkpoint_failed", 4, step=2, severity="critical",
              message="checkpoint step-000002 failed on 1 rank(s): OSError: [Errno 28] No space "
                      "left on device", evidence={"errors": {"0": "OSError: [Errno 28] No space "
                                                                  "left on device"}})
    run.finish(5, 3, 3, rid, reason="abort")
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("storage", "disk_full")


@pytest.mark.parametrize("msg,transient", [
    ("OSError: [Errno 5] Input/output error: '/lustre/ckpt/step-000040/rank3.bin'", False),
    ("OSError: [Errno 116] Stale file handle", True)])
def test_storage_errors(run, msg, transient):
    rid = started(run)
    run.error_file(3, 5, "crash", msg)
    run.launcher_stop(6, rid, 3, "exited with code 3", "crash", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("storage", "crash", transient)


@pytest.mark.parametrize("retries", [1, 0])
def test_a_data_store_down_past_its_retries_is_transient_storage_not_bad_input(run, retries):
    """data/storage.py's error after its retries is an MscaleError (exit 3, kind bad_input),
    which recover read as "fix the input, do not relaunch": a store's outage ended the job for
    good although the same command resumes once the store answers. With remote_retry_s 0 it
    says "after 1 attempt" (not "1 attempts"): the same rule."""
    from mscale.data.storage import Retry
    from mscale.train.failure import one_line

    def down():
        raise ConnectionError("store down")

    with pytest.raises(MscaleError) as e:
        Retry(retries=retries, backoff_s=0.0).call("s3://corpus/web/shard-00003.bin",
                                                   "bytes[262144:524288]", down)
    rid = started(run)
    run.error_file(0, 5, "bad_input", one_line(e.value))
    run.launcher_stop(6, rid, 0, "exited with code 3", "bad_input", [3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("storage", "crash", True)
    assert "data store" in d.summary


@pytest.mark.parametrize("url,error,down", [
    ("/data/web/shard-3.bin", OSError(40, "Too many levels of symbolic links"), False),
    ("/data/web/shard-3.bin", OSError(36, "File name too long"), False),
    ("/mnt/nfs/web/shard-3.bin", TimeoutError("no answer within 60 s"), True),
    ("gs://corpus/web/shard-3.bin", OSError(5, "Input/output error"), True)])
def test_a_local_path_past_its_retries_is_a_store_down_only_when_it_timed_out(run, url, error,
                                                                               down):
    """Local paths are listed through the same retries: a symlink loop or a name too long for
    the filesystem read as 'the remote data store did not answer', transient, and recover
    relaunched into the same failure."""
    from mscale.data.storage import Retry
    from mscale.train.failure import one_line

    def fail():
        raise error

    with pytest.raises(MscaleError) as e:
        Retry(retries=1, backoff_s=0.0).call(url, "list", fail)
    rid = started(run)
    run.error_file(0, 5, "bad_input", one_line(e.value))
    run.launcher_stop(6, rid, 0, "exited with code 3", "bad_input", [3, 3])
    d = diagnose(run.path)
    assert (d.rule == "data_store_down") is down, (d.rule, d.summary)


def test_a_run_directory_gone_read_only_is_storage_not_a_crash_of_rank_0(run):
    """The events file could not take a stop either: rank 0's console line is the record."""
    started(run)
    run.log(0, "step 3/40 loss 5.1\nstopped at step 4: [Errno 30] Read-only file system: "
               "'/scratch/run/metrics.jsonl'; this stop saves no checkpoint; make the run "
               "directory's filesystem writable again, then resume\n")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("storage", "crash", False)
    assert "read-only" in d.summary


def test_bad_input_is_user_code(run):
    run.error_file(0, 5, "bad_input", "checkpoint has no manifest.json; fix: point --resume at "
                   "a committed checkpoint")
    run.event("stop", 6, severity="critical", ranks=[0], message="error (rank 0, bad_input)",
              evidence={"kind": "bad_input", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code, d.transient) == ("user_code", "bad_input", 3, False)


def test_a_type_error_in_user_code_but_not_in_mscale(run, tmp_path):
    user = ('Traceback (most recent call last):\n'
            '  File "/work/main/src/mscale/train/data.py", line 80, in batch\n'
            '    x = self.source(i)\n'
            '  File "/home/alice/mydata/tokens.py", line 12, in __call__\n'
            '    return tok[i] + None\n'
            "TypeError: unsupported operand type(s) for +: 'int' and 'NoneType'\n")
    run.error_file(2, 5, "crash", "TypeError: unsupported operand type(s)", traceback=user)
    assert diagnose(run.path).cls == "user_code"
    other = Run(tmp_path / "other")
    other.error_file(2, 5, "crash", "TypeError: unsupported operand type(s)")
    assert (diagnose(other.path).cls, diagnose(other.path).symptom) == ("software", "crash")


def test_an_import_error_in_a_log(run):
    run.log(0, "Traceback (most recent call last):\n  File \"/opt/job/launch.py\", line 3, in "
            "<module>\n    import flash_attn\nModuleNotFoundError: No module named 'flash_attn'\n")
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("user_code", "crash")
    assert "ModuleNotFoundError" in d.evidence[0].text


def test_nccl_errors_are_network_and_transient(run):
    rid = started(run)
    run.log(1, "NCCL WARN NET/IB : Got completion from peer 10.0.0.3<53334> with error 12, "
            "opcode 0, len 0, vendor err 129\ntorch.distributed.DistBackendError: NCCL error in: "
            "ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
            "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network "
            "error\n")
    run.launcher_stop(6, rid, 1, "exited with code 3", "no error file", [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("network", "crash", True)
    assert d.suspect_ranks == [1]


def test_a_torchelastic_error_file(run):
    record = {"message": {"message": "RuntimeError: CUDA out of memory. Tried to allocate 1.00 "
                                     "GiB", "extraInfo": {
        "py_callstack": 'Traceback (most recent call last):\n  File "/opt/job/x.py", line 1, in '
                        "<module>\nRuntimeError: CUDA out of memory", "timestamp": "1796000005"}}}
    run.file("logs/torchelastic/none_abc/attempt_0/1/error.json", json.dumps(record))
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("software", "oom")
    assert d.evidence[0].source.endswith("error.json")


def test_cuda_error_out_of_memory_is_an_oom_not_a_gpu_fault(run):
    run.error_file(2, 5, "crash", "RuntimeError: CUDA error: out of memory")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_ranks) == ("software", "oom", [2])


def test_a_full_disk_blames_no_node(run):
    rid = started(run)
    run.log(0, "stopped at step 3: checkpoint step-000002 failed: the disk is full; latest stays "
            "step-000001\n")
    run.launcher_stop(6, rid, 0, "exited with code 3", "no error file; its output says why",
                      [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_ranks, d.suspect_nodes) == \
        ("storage", "disk_full", [], [])
