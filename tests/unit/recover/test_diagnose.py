"""diagnose(): one fabricated run per failure class and symptom, in the writers' real shapes."""

from __future__ import annotations

import json
import time

import pytest

from mscale.errors import MscaleError
from mscale.recover.diagnose import diagnose
from tests.unit.recover.diag_runs import GLOO_CLOSED, GLOO_RESET, GLOO_TIMEOUT, T0, Run


@pytest.fixture
def run(tmp_path) -> Run:
    return Run(tmp_path / "run")


def started(run: Run, steps: int = 3) -> str:
    rid = run.start(0.0)
    run.metrics(range(1, steps + 1), t=1.0)
    return rid


def test_a_finished_run_is_none_finished(run):
    rid = started(run, 4)
    run.finish(10, 0, 4, rid)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code, d.attempt, d.failed_step) == ("none", "finished", 0, 1, 4)
    assert d.suspect_ranks == [] and d.suspect_nodes == []


def test_a_halt_is_none_stopped(run):
    rid = started(run)
    run.event("control", 5, step=3, message="saving a checkpoint, then halting")
    run.finish(6, 1, 3, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 1)


def test_a_sigterm_stop_is_a_preemption(run):
    rid = started(run)
    run.event("signal", 5, step=3, message="saving a checkpoint, then halting on a signal")
    run.finish(6, 1, 3, rid, reason="signal")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)


def test_a_ctrl_c_stop_is_the_operators_request_not_a_preemption(run):
    rid = started(run)
    run.finish(6, 1, 3, rid, reason="signal", signal="SIGINT")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 1)


def test_an_interruption_blames_no_node_whatever_the_dying_ranks_wrote(run):
    """A second Ctrl-C under --local: the launcher's ``interrupted`` stop; a rank that saw its
    peer vanish first wrote a network error file, which is no evidence against its node."""
    rid = started(run)
    run.error_file(1, 5, "network", "RuntimeError: Connection closed by peer")
    run.event("stop", 6, severity="warning", message="interrupted: a second Ctrl-C stopped the "
              "workers at once, without a checkpoint; no checkpoint was saved yet",
              evidence={"run_id": rid, "reason": "interrupted", "signal": "SIGINT",
                        "forced": True, "code": 130, "returncodes": [-9, -9, -9, -9]})
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.exit_code) == ("none", "stopped", 130)
    assert d.suspect_nodes == [] and d.suspect_ranks == []


@pytest.mark.parametrize("line", [
    "slurmstepd: error: *** JOB 1234 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO "
    "PREEMPTION ***",
    "slurmstepd: error: *** STEP 1234.0 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO TIME "
    "LIMIT ***"])
def test_slurm_preemption_and_time_limit_explain_the_signals(run, line):
    rid = started(run)
    run.event("signal", 5, step=3, message="halting on a signal")
    run.finish(6, 1, 3, rid, reason="signal")
    run.file("slurm-1234.out", f"step 3/100 loss 5.1\n{line}\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)
    assert d.evidence[0].source == "slurm-1234.out" and "DUE TO" in d.evidence[0].text
    assert d.suspect_nodes == []


def test_a_node_failure_names_the_node(run):
    started(run)
    run.file("logs/slurm-77.out", "srun: error: Node failure on node2\nslurmstepd: error: *** "
             "JOB 77 ON node1 CANCELLED AT 2026-11-30T14:00:01 DUE TO NODE FAILURE ***\n", t=8)
    d = diagnose(run.path)
    assert d.cls == "preemption" and d.suspect_nodes == ["node2"]


def test_scancel_is_a_stop_not_a_preemption(run):
    rid = started(run)
    run.finish(6, 1, 3, rid, reason="signal")
    run.file("slurm-9.out", "slurmstepd: error: *** JOB 9 ON node1 CANCELLED AT "
             "2026-11-30T14:00:01 ***\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped")


def test_kill_9_blames_the_killed_rank_not_the_peers_that_lost_it(run):
    rid = started(run)
    for rank, msg in ((0, GLOO_RESET), (1, GLOO_CLOSED), (3, GLOO_RESET)):
        run.error_file(rank, 5 + rank / 100, "network", msg)
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient, d.exit_code) == ("unknown", "signal", True, 3)
    assert d.suspect_ranks == [2] and d.suspect_nodes == ["node2"]
    assert "SIGKILL" in d.evidence[0].text and d.failed_step == 3


def test_a_rank_gone_silently_under_srun_is_the_suspect(run):
    """No launcher event: rank 0 records its own view; the rank without an error file is the one
    its peers lost."""
    started(run)
    for rank in (0, 1, 2):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 6, severity="critical", ranks=[0], nodes=["node1"],
              message="error (rank 0 on node1, network): ...",
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "crash")
    assert d.suspect_ranks == [3] and d.suspect_nodes == ["node2"] and d.exit_code == 3


def test_when_every_rank_timed_out_under_srun_none_is_named_and_the_report_says_why(run):
    """SLURM continues a stopped rank (SIGCONT, then SIGTERM) when it ends the step: that rank
    times out at once too, so every rank has a timeout file and none is the silent one."""
    from mscale.recover.diagnose.hang import EVERY_RANK_WAITED

    started(run)
    for rank in range(4):
        run.error_file(rank, 5 + rank / 100, "timeout", GLOO_TIMEOUT, node=f"node{rank + 1}")
    run.event("hang", 6, severity="critical", ranks=[0], nodes=["node1"],  # rank 0's, as srun's
              message="error (rank 0 on node1, timeout): ...",
              evidence={"kind": "timeout", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert d.symptom == "hang" and d.suspect_ranks == [] and d.suspect_nodes == []
    assert any(e.text == f"suspect rank(s): {EVERY_RANK_WAITED}" for e in d.evidence)


def test_srun_names_a_killed_task_and_its_node(run):
    run.start(0.0, run_id="slurm-55", launcher="slurm")
    run.error_file(0, 5, "network", GLOO_RESET, node="nodeA")
    run.file("slurm-55.out", "srun: error: nodeB: task 3: Killed\n", t=6)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("unknown", "signal")
    assert d.suspect_ranks == [3] and d.suspect_nodes == ["nodeB"]


def test_nan_is_numerics_with_its_step(run):
    rid = started(run, 2)
    run.event("nan", 4, step=3, severity="critical", message="non-finite gradient norm: stopped "
              "before the optimizer step", evidence={"grad_norm": "nan", "loss": "nan"})
    run.finish(5, 2, 2, rid, reason="nan")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step, d.failed_step, d.exit_code, d.transient) == \
        ("numerics", "nan", 3, 2, 2, True)


def test_a_divergence_names_its_first_bad_step(run):
    rid = started(run, 60)
    run.event("divergence", 70, source="watch", step=60, severity="critical",
              message="the loss diverges", evidence={"first_bad_step": 48, "first_step": 48})
    run.event("control", 71, step=60, message="halting on a control/halt request")
    run.finish(72, 1, 60, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step) == ("numerics", "divergence", 48)
    assert not d.transient and d.suspect_nodes == []


def test_repeated_spikes_roll_back_to_the_first_of_the_episode(run):
    rid = started(run, 60)
    for step in (10, 40, 45, 52):
        run.event("grad_spike", step, source="watch", step=step, severity="warning",
                  message=f"gradient norm spike at step {step}",
                  evidence={"first_step": step, "last_step": step})
    run.finish(80, 1, 60, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.bad_step) == ("numerics", "divergence", 40)


def test_one_spike_in_a_finished_run_is_nothing(run):
    rid = started(run, 20)
    run.event("grad_spike", 10, source="watch", step=10, evidence={"first_step": 10})
    run.finish(30, 0, 20, rid)
    assert diagnose(run.path).cls == "none"


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
            "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error\n")
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


def test_a_slow_node_quarantined_by_watch_then_halted(run):
    rid = started(run, 30)
    run.event("straggler", 20, source="watch", step=30, severity="warning", ranks=[2, 3],
              nodes=["node2"], message="node2 is 40% slower",
              evidence={"cause": "slow_node", "action": "checkpoint requested", "first_step": 24})
    run.finish(25, 1, 30, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("gpu", "straggler")
    assert d.suspect_ranks == [2, 3] and d.suspect_nodes == ["node2"]
    # watch says "step 24", its onset; the event's step is when it was found
    assert any("watch straggler at step 30 (since step 24):" in e.text for e in d.evidence)


def test_an_empty_run_directory_is_unknown_not_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    d = diagnose(str(tmp_path / "empty"))
    assert (d.cls, d.symptom, d.attempt, d.exit_code) == ("unknown", "unknown", 1, None)


def test_a_node_quarantined_during_the_attempt_is_the_reason_of_its_halt(run):
    """supervise halts the job when quarantine.json takes a node in (watch, or an operator)."""
    rid = started(run, 30)
    run.file("quarantine.json", json.dumps({"schema_version": 1, "entries": [
        {"node": "node1", "reason": "operator: fan failure", "since": T0 + 20, "expires": None},
        {"node": "node9", "reason": "old", "since": T0 - 5000, "expires": None}]}))
    run.event("control", 24, step=30, message="halting on a control/halt request")
    run.finish(25, 1, 30, rid, reason="halt")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_nodes) == ("gpu", "straggler", ["node1"])


def test_cuda_error_out_of_memory_is_an_oom_not_a_gpu_fault(run):
    run.error_file(2, 5, "crash", "RuntimeError: CUDA error: out of memory")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_ranks) == ("software", "oom", [2])


def test_train_s_own_lines_quoting_a_path_are_not_evidence(run):
    rid = started(run, 4)
    run.log(0, "training cpu-tiny: tp2·pp1·dp2 on 4 processes (local, cpu), run local-1 attempt 1,"
            " run directory /scratch/oom-kill-enospc-test\nstep 1/8  loss 5.55\n")
    run.launcher_stop(6, rid, 2, "killed by SIGKILL", "killed", [3, 3, -9, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("unknown", "signal")
    assert not any(e.source == "logs/rank0.log" for e in d.evidence)


def test_a_full_disk_blames_no_node(run):
    rid = started(run)
    run.log(0, "stopped at step 3: checkpoint step-000002 failed: the disk is full; latest stays "
            "step-000001\n")
    run.launcher_stop(6, rid, 0, "exited with code 3", "no error file; its output says why",
                      [3, 3, 3, 3])
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.suspect_ranks, d.suspect_nodes) == \
        ("storage", "disk_full", [], [])


def test_a_node_whose_ranks_vanished_under_srun(tmp_path):
    """Both ranks of node3 SIGKILLed under sbatch/srun: the six peers write network error files
    with their real host names, rank 0 records its own stop; the silent node is the suspect."""
    run = Run(tmp_path / "run", nodes="node[1-4]", tp=2, dp=4)
    launch = {"argv": ["mscale", "train", "plan.yaml"], "nodes": ["node1", "node2", "node3",
                                                                  "node4"],
              "slurm": {"job_id": "42", "job_name": "t", "nodelist": "node[1-4]", "nnodes": 4}}
    run.start(0.0, run_id="slurm-42.0", launcher="slurm", launch=launch)
    run.metrics(range(1, 6), t=1)
    for rank in (0, 1, 2, 3, 6, 7):
        run.error_file(rank, 20 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 21, severity="critical", ranks=[0], nodes=["node1"],
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    d = diagnose(run.path)
    assert (d.cls, d.suspect_ranks, d.suspect_nodes, d.exit_code) == \
        ("network", [4, 5], ["node3"], 3)


def test_a_dead_launcher_blames_no_node_and_a_closed_console_is_software(run, tmp_path):
    """train --local's workers stop themselves when their launcher dies (launcher_died on every
    rank, a peer's collective broken by the first to stop): nothing of a node or the network.
    A rank whose stdout/stderr reader went away (kind console) is not a network fault, though
    its traceback says 'Broken pipe'."""
    started(run)
    for rank in range(4):
        run.error_file(rank, 6, "launcher_died", "the --local launcher is gone (killed)")
    run.error_file(2, 6, "network", "RuntimeError: Connection closed by peer")
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("preemption", "preempted", True)
    assert d.suspect_nodes == [] and d.suspect_ranks == []

    other = Run(tmp_path / "console")
    started(other)
    other.error_file(0, 5, "console", "BrokenPipeError: [Errno 32] Broken pipe")
    d = diagnose(other.path)
    assert (d.cls, d.symptom) == ("software", "crash") and d.suspect_nodes == []


# -- srun --kill-on-bad-exit=1: the step's cancel is its teardown, not an operator's scancel ---


def _stamp(t: float) -> str:
    """slurmstepd's time of a cancel (the node's local time, whole seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + t))


def _killed_under_srun(tmp_path) -> Run:
    """The trial's run: 8 ranks on node[1-4] under ``srun --kill-on-bad-exit=1 --output
    RUN/logs/…``; rank 4 (node3) SIGKILLed; its peers lose it; srun says so, cancels the step,
    and the other tasks end with it."""
    run = Run(tmp_path / "r1", nodes="node[1-4]", tp=2, dp=4)
    run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    for rank in (0, 5):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.event("stop", 5.5, severity="critical", ranks=[0], nodes=["node1"],
              message="error (rank 0 on node1, network): ...",
              evidence={"kind": "network", "error_file": "logs/rank0.error.json"})
    run.file("logs/slurm-25.out",
             "step 3/100 loss 5.1\n"
             "srun: error: node3: task 4: Killed\n"
             "srun: launch/slurm: _step_signal: Terminating StepId=25.0\n"
             f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             "srun: error: node1: tasks 0-1: Killed\n"
             "srun: error: node3: task 5: Exited with exit code 3\n", t=7)
    return run


def test_kill_on_bad_exit_blames_the_killed_rank_not_a_scancel(tmp_path):
    d = diagnose(_killed_under_srun(tmp_path).path)
    assert (d.cls, d.symptom) == ("unknown", "signal"), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]
    assert "task 4: Killed" in d.evidence[0].text
    assert "cancelled (scancel)" not in d.summary


def test_kill_on_bad_exit_with_an_xid_is_the_gpu_and_excludes_its_node(tmp_path):
    from mscale.recover.exclude import decide_exclusions
    from mscale.runs.rundir import RunDir

    run = _killed_under_srun(tmp_path)
    run.log(4, "step 3/100 loss 5.1\nNVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen "
            "off the bus.\n", t=5)
    d = diagnose(run.path)
    assert (d.cls, d.symptom, d.transient) == ("gpu", "crash", False), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]
    assert decide_exclusions(RunDir(run.path), d).nodes == ["node3"]


def test_a_step_cancel_after_a_failed_rank_with_no_srun_line_is_no_scancel(tmp_path):
    """The step's cancel in a rank's own --output file, srun's own lines elsewhere: the error
    files written before it say the job failed first."""
    _failed_then_cancelled(tmp_path, _stamp(6))


def _failed_then_cancelled(tmp_path, stamp: str, launch: dict | None = None) -> None:
    """Every rank but 4 fails at T0 + 5 (rank 4's loss), the step is cancelled at ``stamp``:
    diagnosed as the network failure, not a scancel."""
    run = Run(tmp_path / "r1", nodes="node[1-4]", tp=2, dp=4)
    run.start(0.0, run_id="slurm-25", launcher="slurm", launch=launch)
    run.metrics(range(1, 4), t=1.0)
    for rank in (0, 1, 2, 3, 5, 6, 7):
        run.error_file(rank, 5 + rank / 100, "network", GLOO_RESET, node=f"node{rank // 2 + 1}")
    run.log(1, f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {stamp} ***\n", t=6)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "crash"), d.summary
    assert d.suspect_ranks == [4] and d.suspect_nodes == ["node3"]


def test_a_cancel_is_read_in_the_nodes_time_zone_not_recovers(tmp_path):
    """The nodes keep UTC-9, recover runs in this machine's zone: read as local time here the
    cancel's stamp would lie hours before the failures and the step's teardown would read as an
    operator's scancel; the start event's recorded offset places it after them."""
    offset = time.localtime(T0).tm_gmtoff - 9 * 3600  # nine hours west of this machine
    node_time = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(T0 + 6 + offset))
    _failed_then_cancelled(tmp_path, node_time, launch={
        "nodes": ["node1", "node2", "node3", "node4"], "utc_offset_s": offset})


def test_an_operators_step_scancel_is_still_a_stop(run):
    """``scancel 25.0``: no task failed before the cancel; the tasks' SIGTERM stop and srun's
    lines about them come after it."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT "
             f"{_stamp(6)} ***\nsrun: error: node1: tasks 0-1: Exited with exit code 1\n"
             "srun: error: node2: tasks 2-3: Terminated\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and "scancel" in d.summary


def test_an_operators_job_scancel_is_still_a_stop_whatever_the_step_says(run):
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", f"slurmstepd: error: *** JOB 25 ON node1 CANCELLED AT {_stamp(6)} "
             f"***\nslurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             "srun: error: node1: tasks 0-3: Terminated\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and d.suspect_nodes == []


def test_supervises_own_halt_under_slurm_is_the_slow_link_not_a_scancel(run):
    """``recover supervise --watch -- srun --kill-on-bad-exit=1 …``: watch names a slow link,
    supervise asks for a halt, the tasks exit 1 after the checkpoint, srun cancels the step."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 31), t=1.0)
    run.event("straggler", 20, source="watch", step=30, severity="warning", ranks=[2, 3],
              nodes=["node2"], message="the link to node2 is slow",
              evidence={"cause": "slow_link", "action": "checkpoint requested"})
    run.event("control", 24, step=30, message="halting on a control/halt request")
    run.finish(25, 1, 30, rid, reason="halt")
    run.file("slurm-25.out", "srun: error: node1: task 0: Exited with exit code 1\n"
             f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT {_stamp(26)} ***\n"
             "srun: error: node2: tasks 2-3: Exited with exit code 1\n", t=27)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("network", "straggler"), d.summary
    assert d.suspect_nodes == ["node2"] and "scancel" not in d.summary


def test_a_step_of_a_job_cancelled_due_to_a_time_limit_is_the_time_limit(run):
    run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.file("slurm-25.out", f"slurmstepd: error: *** STEP 25.0 ON node1 CANCELLED AT "
             f"{_stamp(6)} ***\nslurmstepd: error: *** JOB 25 ON node1 CANCELLED AT "
             f"{_stamp(6)} DUE TO TIME LIMIT ***\n", t=7)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("preemption", "preempted")
    assert all(not (h.source == "slurm-25.out" and "STEP" in h.text and h is d.evidence[0])
               for h in d.evidence)


def test_a_job_scancel_after_an_earlier_steps_failure_is_still_the_operators(run):
    """--open-mode=append keeps every step in one file: preflight's step exited 1 (its warnings),
    training ran, then the operator cancelled the job."""
    rid = run.start(0.0, run_id="slurm-25", launcher="slurm")
    run.metrics(range(1, 4), t=1.0)
    run.finish(9, 1, 3, rid, reason="signal")
    run.file("slurm-25.out", "srun: error: node1: tasks 0-3: Exited with exit code 1\n"
             f"slurmstepd: error: *** JOB 25 ON node1 CANCELLED AT {_stamp(6)} ***\n"
             f"slurmstepd: error: *** STEP 25.1 ON node1 CANCELLED AT {_stamp(6)} ***\n", t=9)
    d = diagnose(run.path)
    assert (d.cls, d.symptom) == ("none", "stopped") and "scancel" in d.summary
