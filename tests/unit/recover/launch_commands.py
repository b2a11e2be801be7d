"""Launch commands and a re-plan's change for the tests of the rewrite (test_command.py) and
the relaunch (test_relaunch.py)."""

from __future__ import annotations

from mscale.recover.command import Change

MSCALE = "/venv/bin/mscale"
NODES = ["node1", "node2", "node3", "node4"]


def shrink(**kw) -> Change:
    """node3 out, re-planned for 6 ranks on 3 nodes."""
    args = dict(world=6, nodes=["node1", "node2", "node4"], excluded=["node3"],
                plan_path="/runs/r1/recover/plan-0001.yaml")
    return Change(**{**args, **kw})
