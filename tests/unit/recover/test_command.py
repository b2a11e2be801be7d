"""command.py: the srun/sbatch node flags of a rewritten launch command."""

from __future__ import annotations

import pytest

from mscale.errors import MscaleError
from mscale.recover.command import Change, rewrite_command


def test_attached_short_node_flags_are_replaced_and_their_exclusions_kept():
    """`srun -xnode9 -N2 ...` kept both words after the new `--nodes=`/`--exclude=`: srun takes
    the last of a repeated option, so the node recover excluded ran again (and -N2 stood)."""
    change = Change(world=4, nodes=[], excluded=["node3"])
    cmd = ["srun", "-xnode9", "-N2", "-n8", "mscale", "train", "p.yaml"]
    out = rewrite_command(cmd, change, 4)
    assert out == ["srun", "--nodes=1", "--ntasks=4", "--exclude=node[3,9]",
                   "mscale", "train", "p.yaml"]


def test_an_exclude_file_is_read_as_slurm_reads_it(tmp_path):
    """srun's --exclude with a '/' names a file of nodes: appending to the path made an invalid
    value."""
    names = tmp_path / "bad-nodes"
    names.write_text("node7\nnode[8-9]\n")
    change = Change(world=4, nodes=[], excluded=["node3"])
    out = rewrite_command(["srun", f"--exclude={names}", "mscale", "train", "p.yaml"], change, 4)
    assert "--exclude=node[3,7-9]" in out and not any(str(names) in w for w in out)


@pytest.mark.parametrize("value", ["node[3", "/nonexistent/bad-nodes"])
def test_an_exclude_recover_cannot_read_is_refused_not_dropped(value):
    change = Change(world=4, nodes=[], excluded=["node3"])
    with pytest.raises(MscaleError, match="recover would drop the nodes it keeps out") as e:
        rewrite_command(["srun", "-x", value, "mscale", "train", "p.yaml"], change, 4)
    assert e.value.field == "CMD" and "hostlist" in e.value.fix


def test_a_node_back_in_the_pool_leaves_the_commands_exclusions():
    """Kept out by an earlier recovery while quarantined; its quarantine expired since."""
    change = Change(world=8, nodes=[], excluded=["node3"], released=["node9"])
    cmd = ["srun", "--exclude=node[7,9]", "mscale", "train", "p.yaml"]
    assert "--exclude=node[3,7]" in rewrite_command(cmd, change, 4)


@pytest.mark.parametrize("cmd, nodes", [
    (["srun", "-x", "node4", "-xnode5", "mscale", "train", "p.yaml"], ["node4", "node5"]),
    (["sbatch", "--exclude=node2", "--wrap", "srun -x node[4,6] mscale train p.yaml"],
     ["node2", "node4", "node6"]),
    (["sbatch", "--wrap=srun --exclude=node7 mscale train p.yaml"], ["node7"]),
    (["torchrun", "--nnodes=2", "mscale", "train", "p.yaml"], []),
    (["mscale", "train", "p.yaml", "--local", "8"], [])])
def test_the_nodes_a_command_keeps_out_are_read_where_the_rewrite_keeps_them(cmd, nodes):
    """What the re-plan must not count is what the rewritten command goes on excluding."""
    from mscale.recover.command import command_exclusions

    assert command_exclusions(cmd) == nodes


def test_a_batch_jobs_option_value_that_names_a_file_is_not_taken_for_its_script(tmp_path):
    """`sbatch --exclude /etc/bad-nodes job.sh`: the exclude file was taken for the batch
    script, so the new options went after it, where sbatch hands them to the script."""
    names, script, log = tmp_path / "bad-nodes", tmp_path / "job.sh", tmp_path / "old.out"
    names.write_text("node7\n")
    script.write_text("#!/bin/bash\nsrun mscale train p.yaml\n")
    log.write_text("")
    change = Change(world=4, nodes=[], excluded=["node3"])
    for opts in (["--exclude", str(names)], ["-o", str(log), "-x", str(names)],
                 ["--wait", "-x", str(names)]):
        out = rewrite_command(["sbatch", *opts, str(script)], change, 4)
        assert out[-1] == str(script), out
        assert "--exclude=node[3,7]" in out, out
