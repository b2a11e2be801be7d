"""command.py: the srun/sbatch node flags of a rewritten launch command."""

from __future__ import annotations

from mscale.recover.command import Change, rewrite_command


def test_attached_short_node_flags_are_replaced_and_their_exclusions_kept():
    """`srun -xnode9 -N2 ...` kept both words after the new `--nodes=`/`--exclude=`: srun takes
    the last of a repeated option, so the node recover excluded ran again (and -N2 stood)."""
    change = Change(world=4, nodes=[], excluded=["node3"])
    cmd = ["srun", "-xnode9", "-N2", "-n8", "mscale", "train", "p.yaml"]
    out = rewrite_command(cmd, change, 4)
    assert out == ["srun", "--nodes=1", "--ntasks=4", "--exclude=node[3,9]",
                   "mscale", "train", "p.yaml"]
