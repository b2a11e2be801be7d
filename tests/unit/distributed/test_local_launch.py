"""The local launcher's verdict on who failed first (distributed/launch.py `_watch`)."""

from __future__ import annotations

from mscale.distributed.launch import _watch


class _Ended:
    """A worker that has already ended with ``code`` (negative: killed by that signal)."""

    def __init__(self, code: int):
        self.returncode, self.pid = code, 0

    def poll(self) -> int:
        return self.returncode


def test_a_killed_rank_is_first_even_when_every_worker_ended_between_two_polls():
    # rank 2 was killed; its peers lost their connection and exited 3 before the launcher
    # looked (a loaded machine): the launcher must still name rank 2, not rank 0
    result = _watch([_Ended(3), _Ended(3), _Ended(-9), _Ended(3)])
    assert (result.failed_rank, result.code) == (2, 3)


def test_without_a_signal_the_lowest_failed_rank_is_named():
    result = _watch([_Ended(0), _Ended(3), _Ended(3)])
    assert result.failed_rank == 1


def test_an_agreed_stop_is_no_failure():
    result = _watch([_Ended(2), _Ended(2)])
    assert (result.failed_rank, result.code) == (None, 2)


def test_a_rendezvous_port_is_drawn_outside_the_ephemeral_range(monkeypatch):
    """A port from bind(0) lies where every outgoing connection takes its local port: a gloo
    connection of another job took one between the check and rank 0's bind (EADDRINUSE)."""
    from mscale.distributed import launch

    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (32768, 60999))
    ports = {launch.free_port() for _ in range(20)}
    assert all(20000 <= p < 32768 for p in ports) and len(ports) > 1
