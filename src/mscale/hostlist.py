"""SLURM hostlists in and out (``node[001-004,007]``), via the python-hostlist package.

A leaf: pure text in, text out, importing nothing from mscale, so the cluster schema (config) can
validate its ``hostlist`` field and the launcher environment (topology) can read SLURM's node list
without either importing the other (docs/architecture.md, "Layers"). The layers above use it
as well: preflight and recover to write node lists (an exclude list, srun's and sbatch's
``--nodelist``/``--exclude``), recover and watch to read them (a job's nodes, ``--hostlist``).
"""

from __future__ import annotations

import re

import hostlist as _hl

_SEPARATORS = re.compile(r"\s*,\s*|\s+")
"""What separates hosts: a comma, blanks or both. SLURM splits on blanks as on commas
(``scontrol show hostnames "node1, node2"`` names node1 and node2); python-hostlist does not,
and ``node1, node2`` became a node named `` node2`` that no launcher reports and no
``--exclude`` matches."""


def expand_hostlist(text: str, unique: bool = True) -> list[str]:
    """``node[1-3]`` → ``['node1', 'node2', 'node3']``; raises ValueError on bad syntax.

    Hosts may be separated by commas and/or blanks, as SLURM takes them. ``unique`` (default)
    drops repeated names, keeping the first; False keeps them, for a caller that must refuse
    them (a cluster file's node list)."""
    try:
        return _hl.expand_hostlist(_SEPARATORS.sub(",", text.strip()),
                                   allow_duplicates=not unique)
    except _hl.BadHostlist as e:
        raise ValueError(f"bad hostlist {text!r}: {e}") from None


def collect_hostlist(hosts: list[str]) -> str:
    """The shortest SLURM expression for a set of hosts (order-insensitive); '' for none."""
    return _hl.collect_hostlist(list(hosts)) if hosts else ""
