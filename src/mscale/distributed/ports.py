"""A TCP port for a local job's rendezvous, drawn where no other connection takes it first.

Used by the ``--local`` launcher (distributed/launch.py) and by the N gloo processes of tests and
bench/ (distributed/spawn.py).
"""

from __future__ import annotations

import random
import socket


LISTEN_PORTS = (20000, 32768)
"""Where a local job's rendezvous port is drawn from: below Linux's default ephemeral range
(32768-60999). A port the kernel hands out for ``bind(0)`` lies in the range every outgoing
connection draws its local port from, so between the check and rank 0's own bind a gloo
connection of any other job could take it (``EADDRINUSE``, seen with two test workers beside a
demo run)."""


def free_port() -> int:
    """A TCP port free on this machine now, for a local job's rendezvous (the ``--local``
    launchers and `mscale.distributed.spawn`): one of `LISTEN_PORTS` outside the kernel's
    ephemeral range, else (a machine whose range covers them) any the kernel gives."""
    low, high = _ephemeral_range()
    ports = [p for p in range(*LISTEN_PORTS) if not low <= p <= high]
    for port in random.sample(ports, min(64, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
