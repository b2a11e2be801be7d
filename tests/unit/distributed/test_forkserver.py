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


def test_spawning_can_be_asked_for(monkeypatch):
    import importlib

    monkeypatch.setenv("MSCALE_SPAWN_WORKERS", "1")
    assert importlib.reload(forkserver).FORK_WORKERS is False
    monkeypatch.delenv("MSCALE_SPAWN_WORKERS")
    importlib.reload(forkserver)
