"""SLURM hostlists in and out (``node[001-004,007]``), via the python-hostlist package.

A leaf: pure text in, text out, importing nothing from mscale, so the cluster schema (config) can
validate its ``hostlist`` field and the launcher environment (topology) can read SLURM's node list
without either importing the other (docs/architecture.md, "Layers"). The layers above use it
as well: preflight and recover to write node lists (an exclude list, srun's and sbatch's
``--nodelist``/``--exclude``), recover and watch to read them (a job's nodes, ``--hostlist``).
"""

from __future__ import annotations

import hostlist as _hl


def expand_hostlist(text: str) -> list[str]:
    """``node[1-3]`` → ``['node1', 'node2', 'node3']``; raises ValueError on bad syntax."""
    try:
        return _hl.expand_hostlist(text.strip())
    except _hl.BadHostlist as e:
        raise ValueError(f"bad hostlist {text!r}: {e}") from None


def collect_hostlist(hosts: list[str]) -> str:
    """The shortest SLURM expression for a set of hosts (order-insensitive); '' for none."""
    return _hl.collect_hostlist(list(hosts)) if hosts else ""
