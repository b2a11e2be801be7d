"""Local workers forked from the fork server, and spawned where forking is off
(distributed/forkserver.py): each sees its own environment and arguments, writes its own log
(rank 0 also to the console), and ends with its own exit code or minus the signal that killed it."""

from __future__ import annotations

import os
import signal

import pytest

from mscale.distributed import forkserver
from mscale.distributed.launch import pid_file, run_local_workers

ENTRY = ("import os, signal, sys, time\n"
         # the launcher stops the others after the first failure: ignored here, so the codes
         # under test are the workers' own however the three are scheduled
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "rank, sync = int(os.environ['RANK']), os.environ['SYNC']\n"
         "print(f'rank {rank} of {os.environ[\"WORLD_SIZE\"]} args {sys.argv[1:]} "
         "node {os.environ.get(\"MSCALE_NODE\")}', flush=True)\n"
         # written whole, then renamed: a reader never sees the file empty
         "tmp = os.path.join(sync, f'.pid{rank}')\n"
         "open(tmp, 'w').write(str(os.getpid()))\n"
         "os.replace(tmp, os.path.join(sync, f'pid{rank}'))\n"
         "def until(done):\n"
         "    end = time.time() + 60\n"
         "    while not done() and time.time() < end:\n"
         "        time.sleep(0.01)\n"
         # reaped, not merely a zombie: the server reports statuses in reaping order
         "def gone(pid):\n"
         "    return not os.path.exists(f'/proc/{pid}')\n"
         "until(lambda: all(os.path.exists(os.path.join(sync, f'pid{r}')) for r in range(3)))\n"
         "if rank == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
         "if rank == 1:  # after rank 2 is reaped, so that the launcher sees the signal first\n"
         "    until(lambda: gone(int(open(os.path.join(sync, 'pid2')).read())))\n"
         "sys.exit(3 if rank == 1 else 0)\n")


@pytest.mark.parametrize("fork", [True, False])
def test_each_worker_has_its_own_environment_log_and_exit(tmp_path, capsys, monkeypatch, fork):
    monkeypatch.setattr(forkserver, "FORK_WORKERS", fork)
    logs = str(tmp_path / "logs")
    (tmp_path / "sync").mkdir()
    result = run_local_workers(3, 1, ["a", "b"], logs, {"SYNC": str(tmp_path / "sync")},
                               entry=ENTRY,
                               phases=(), node_names=("n1", "n2", "n3"), preload=())
    assert result.returncodes == [0, 3, -signal.SIGKILL]
    assert result.failed_rank == 2  # a signal beats an exit code
    for rank in range(3):
        text = open(os.path.join(logs, f"rank{rank}.log")).read()
        assert f"rank {rank} of 3 args ['a', 'b'] node n{rank + 1}" in text
        assert int(open(pid_file(logs, rank)).read()) > 0
    assert "rank 0 of 3" in capsys.readouterr().out  # rank 0 is teed to the console


@pytest.mark.parametrize("fork", [True, False])
def test_an_exception_the_entry_leaves_unhandled_is_a_crash_not_a_halt(tmp_path, monkeypatch,
                                                                       fork):
    """Python exits 1 on an uncaught exception: the contract's "halted on request"."""
    monkeypatch.setattr(forkserver, "FORK_WORKERS", fork)
    logs = str(tmp_path / "logs")
    result = run_local_workers(1, 1, [], logs, {}, entry="import no_such_module_here",
                               phases=(), node_names=("n1",), preload=())
    assert result.returncodes == [3] and result.failed_rank == 0
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in open(
        os.path.join(logs, "rank0.log")).read()


def test_the_result_keeps_rank_0s_last_line(tmp_path):
    """Rank 0's own word on how it ended, which the launcher judges a full disk's stop by when
    the disk kept it out of events.jsonl (train/job_watch.py `agreed_stop`)."""
    entry = ("import sys\nprint('step 1/2', flush=True)\nprint('stopped at step 2: why')\n"
             "sys.exit(3)")
    result = run_local_workers(1, 1, [], str(tmp_path / "logs"), {}, entry=entry, phases=(),
                               node_names=("n1",), preload=())
    assert result.returncodes == [3] and result.rank0_last_line == "stopped at step 2: why"


def test_a_line_rank_0_puts_in_its_log_alone_is_kept(tmp_path):
    """Rank 0 appends a line to its log itself (`say_in_log`: a second Ctrl-C's
    `rank 0: interrupted`, a lost peer) while the launcher's tee writes what rank 0 printed:
    the tee wrote at its own offset, over the appended line."""
    entry = ("from mscale.distributed.lifeline import say_in_log\n"
             "print('before', flush=True)\n"
             "say_in_log('rank 0: interrupted\\n')\n"
             "print('after', flush=True)\n")
    logs = tmp_path / "logs"
    result = run_local_workers(1, 1, [], str(logs), {}, entry=entry, phases=(),
                               node_names=("n1",), preload=())
    assert result.returncodes == [0]
    assert sorted((logs / "rank0.log").read_text().splitlines()) == [
        "after", "before", "rank 0: interrupted"]


def test_the_guard_keeps_the_entry_as_written():
    """Not re-indented: a multi-line string keeps its lines, a __future__ import stays first."""
    import subprocess
    import sys

    entry = ("from __future__ import annotations\nimport sys\nx = \"\"\"a\nb\"\"\"\n"
             "print(repr(x), __name__, sys.argv[1:])\nsys.exit(7)\n")
    p = subprocess.run([sys.executable, "-c", forkserver.guarded(entry), "arg"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 7 and p.stdout == "'a\\nb' __main__ ['arg']\n", p.stdout + p.stderr


def test_spawning_can_be_asked_for(monkeypatch):
    import importlib

    monkeypatch.setenv("MSCALE_SPAWN_WORKERS", "1")
    assert importlib.reload(forkserver).FORK_WORKERS is False
    monkeypatch.delenv("MSCALE_SPAWN_WORKERS")
    importlib.reload(forkserver)


SLOW_PRELOAD = ("import os, time\n"
                "open(os.environ['MARK'] + '.tmp', 'w').write(str(os.getpid()))\n"
                "os.replace(os.environ['MARK'] + '.tmp', os.environ['MARK'])\n"
                "time.sleep(1.5)\n")
"""A module the server imports before it serves: it names the server's pid, then takes a while."""

LAUNCH = ("import sys\n"
          "from mscale.distributed.launch import run_local_workers\n"
          "r = run_local_workers(1, 1, [], sys.argv[1], {}, entry='print(\"worker ran\")',\n"
          "                      phases=(), node_names=('n1',), preload=('slowpreload',))\n"
          "print('codes', r.returncodes)\n")


def test_a_ctrl_c_while_the_server_imports_its_preload_neither_kills_it_nor_prints(tmp_path):
    """A Ctrl-C reaches the whole foreground process group, the fork server included: in its
    first second, while it imports torch, it would die in a KeyboardInterrupt traceback and fail
    the start. Run in a fresh interpreter: this one's server, if started, has loaded already."""
    import subprocess
    import sys
    import time

    (tmp_path / "slowpreload.py").write_text(SLOW_PRELOAD)
    mark = tmp_path / "server.pid"
    env = {**os.environ, "MARK": str(mark),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH, str(tmp_path / "logs")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not mark.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.01)
    os.kill(int(mark.read_text()), signal.SIGINT)  # as the terminal would, mid-import
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert "codes [0]" in out and "Traceback" not in err + out
    assert "worker ran" in (tmp_path / "logs" / "rank0.log").read_text()


def test_a_killed_worker_is_named_at_once_with_its_node():
    from mscale.distributed.launch import LocalJob, failure_seen_line
    from mscale.distributed.watcher import describe_exit

    job = LocalJob(4, 2, [], "logs", {}, node_names=("node1", "node2"))
    assert failure_seen_line(job, [None, None, -signal.SIGKILL, 3]).startswith(
        "rank 2 on node2 killed by SIGKILL; stopping the other workers")
    assert describe_exit(-200) == "killed by signal 200" and describe_exit(None) == \
        "still running"


FIRST_END = ("import os, signal, sys, time\n"
             "rank, sync, how = int(os.environ['RANK']), os.environ['SYNC'], sys.argv[1]\n"
             "if rank != 1: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             "open(os.path.join(sync, f'.p{rank}'), 'w').write('x')\n"
             "os.replace(os.path.join(sync, f'.p{rank}'), os.path.join(sync, f'p{rank}'))\n"
             "end = time.time() + 60\n"
             "while len(os.listdir(sync)) < 3 and time.time() < end: time.sleep(0.01)\n"
             "if how == 'kill' and rank == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
             "if how == 'exit' and rank == 0: sys.exit(3)\n"
             "time.sleep(60 if rank == 1 else 2)\n"  # rank 1 waits for the launcher's SIGTERM
             "sys.exit(3)\n")


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_the_killed_line_judges_the_first_end_only_not_the_launchers_own_signals(
        tmp_path, capsys, monkeypatch, how):
    """A worker the launcher itself stops (SIGTERM here) after another's exit 3 is no 'killed'
    worker: the line is decided once, at the first end seen."""
    monkeypatch.setattr(forkserver, "FORK_WORKERS", False)  # spawned: SIGTERM at its default
    (tmp_path / "sync").mkdir()
    result = run_local_workers(3, 1, [how], str(tmp_path / "logs"),
                               {"SYNC": str(tmp_path / "sync")}, entry=FIRST_END, phases=(),
                               node_names=("n1", "n2", "n3"), preload=())
    out = capsys.readouterr().out
    assert result.returncodes[1] == -signal.SIGTERM  # stopped by the launcher
    if how == "kill":
        assert result.failed_rank == 2
        assert "rank 2 on n3 killed by SIGKILL; stopping the other workers" in out, out
    else:
        assert result.failed_rank == 0 and "stopping the other workers" not in out, out


def test_a_job_the_launcher_abandons_is_killed_at_once_and_says_why(tmp_path, capsys):
    """`LocalJob.abandon` (train: its run lock taken over by another job) kills the workers at
    the next poll, without waiting for them, and the result says why."""
    import time

    logs = str(tmp_path / "logs")
    t0 = time.monotonic()
    result = run_local_workers(2, 1, [], logs, {}, entry="import time; time.sleep(60)",
                               phases=(), node_names=("n1", "n2"), preload=(),
                               abandon=lambda: "taken over" if time.monotonic() - t0 > 1
                               else None)
    assert result.abandoned == "taken over" and time.monotonic() - t0 < 30
    assert result.returncodes == [-signal.SIGKILL, -signal.SIGKILL]
    assert "stopping the workers now, without a checkpoint: taken over" in \
        capsys.readouterr().out
