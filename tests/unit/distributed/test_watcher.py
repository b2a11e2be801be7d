"""The local launcher's verdict on who failed first (distributed/watcher.py `watch_workers`)."""

from __future__ import annotations

from mscale.distributed.watcher import watch_workers


class _Ended:
    """A worker that has already ended with ``code`` (negative: killed by that signal)."""

    def __init__(self, code: int):
        self.returncode, self.pid = code, 0

    def poll(self) -> int:
        return self.returncode


def test_a_killed_rank_is_first_even_when_every_worker_ended_between_two_polls():
    # rank 2 was killed; its peers lost their connection and exited 3 before the launcher
    # looked (a loaded machine): the launcher must still name rank 2, not rank 0
    result = watch_workers([_Ended(3), _Ended(3), _Ended(-9), _Ended(3)])
    assert (result.failed_rank, result.code) == (2, 3)


def test_without_a_signal_the_lowest_failed_rank_is_named():
    result = watch_workers([_Ended(0), _Ended(3), _Ended(3)])
    assert result.failed_rank == 1


def test_an_agreed_stop_is_no_failure():
    result = watch_workers([_Ended(2), _Ended(2)])
    assert (result.failed_rank, result.code) == (None, 2)
