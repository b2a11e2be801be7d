"""A local job's rendezvous port (distributed/ports.py)."""

from __future__ import annotations

from mscale.distributed import ports


def test_a_rendezvous_port_is_drawn_outside_the_ephemeral_range(monkeypatch):
    """A port from bind(0) lies where every outgoing connection takes its local port: a gloo
    connection of another job took one between the check and rank 0's bind (EADDRINUSE)."""
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32768, 60999))
    drawn = {ports.free_port() for _ in range(20)}
    assert all(20000 <= p < 32768 for p in drawn) and len(drawn) > 1
