"""command.py: the argv surgery of a relaunch — the plan, --local N, --resume, train's flags,
srun/sbatch node flags and exclusions, torchrun --nnodes — on the recorded or given command."""

from __future__ import annotations

import pytest

from mscale.errors import MscaleError
from mscale.recover.command import Change, rewrite_command, rewrite_train, set_option
from mscale.recover.relaunch import launcher_of

from tests.unit.recover.launch_commands import MSCALE, NODES, shrink

ARGV = [MSCALE, "train", "plans/cpu-tiny.yaml", "--run-dir", "runs/r1", "--local", "8",
        "--steps", "20", "--json"]


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


def test_local_gets_the_new_plan_and_world_and_keeps_everything_else():
    out = rewrite_train(ARGV, shrink(), local=True)
    assert out == [MSCALE, "train", "/runs/r1/recover/plan-0001.yaml", "--run-dir", "runs/r1",
                   "--local", "6", "--steps", "20", "--json"]


def test_a_changed_batch_tells_train_it_may():
    out = rewrite_train(ARGV, shrink(allow_batch_change=True), local=True)
    assert out[-1] == "--allow-batch-change" and out[2] == "/runs/r1/recover/plan-0001.yaml"
    again = rewrite_train(out, shrink(allow_batch_change=True), local=True)
    assert again.count("--allow-batch-change") == 1
    assert "--allow-batch-change" not in rewrite_train(ARGV, shrink(), local=True)


def test_a_rollback_sets_resume_in_either_spelling():
    change = Change(world=8, nodes=NODES, resume="/runs/r1/ckpt/step-000010")
    assert rewrite_train(ARGV, change, local=True)[-2:] == ["--resume",
                                                            "/runs/r1/ckpt/step-000010"]
    argv = [MSCALE, "train", "p.yaml", "--resume=auto", "--run-dir", "r"]
    assert rewrite_train(argv, change, local=False)[3] == "--resume=/runs/r1/ckpt/step-000010"


def test_the_plan_is_found_after_options_and_flags():
    argv = ["mscale", "train", "--run-dir", "r", "--json", "--timeout=30", "p.yaml", "--steps",
            "5"]
    out = rewrite_train(argv, shrink(), local=False)
    assert out[6] == "/runs/r1/recover/plan-0001.yaml" and "--local" not in out
    assert rewrite_train(["python", "-m", "mscale.cli.main", "train", "p.yaml"], shrink(),
                         local=False)[4] == "/runs/r1/recover/plan-0001.yaml"


def test_nothing_changes_when_nothing_changed():
    same = Change(world=8, nodes=NODES)
    assert same.unchanged and rewrite_train(ARGV, same, local=True) == ARGV


def test_set_option_appends_when_absent():
    assert set_option(["a"], "--nnodes", "3") == ["a", "--nnodes", "3"]


def test_srun_command_gets_nodes_tasks_and_exclude():
    cmd = ["srun", "-N", "4", "-n", "8", "--ntasks-per-node=2", "--exclude=node9", MSCALE,
           "train", "plan.yaml", "--run-dir", "r"]
    out = rewrite_command(cmd, shrink(), ranks_per_node=2)
    assert out == ["srun", "--nodes=3", "--ntasks=6", "--exclude=node[3,9]",
                   "--ntasks-per-node=2", MSCALE, "train", "/runs/r1/recover/plan-0001.yaml",
                   "--run-dir", "r"]


def test_a_rewritten_command_keeps_the_nodes_it_already_excluded():
    """supervise -- srun -x node9 …: the relaunch dropped the user's (or an earlier recovery's)
    --exclude for the new one alone, so a node kept out came back in the next step."""
    srun = ["srun", "-x", "node9", "--exclude", "node[7-8]", MSCALE, "train", "p.yaml"]
    out = rewrite_command(srun, shrink(), ranks_per_node=2)
    assert out[:4] == ["srun", "--nodes=3", "--ntasks=6", "--exclude=node[3,7-9]"]
    assert "-x" not in out and "node9" not in out
    sbatch = ["sbatch", "--wait", "-x", "node9", "job.sh"]
    assert rewrite_command(sbatch, shrink(), 2) == ["sbatch", "--nodes=3", "--exclude=node[3,9]",
                                                    "--wait", "job.sh"]


def test_torchrun_command_gets_nnodes():
    cmd = ["torchrun", "--nnodes=4", "--nproc-per-node=2", "--no-python", "mscale", "train",
           "plan.yaml", "--run-dir", "r"]
    out = rewrite_command(cmd, shrink(), ranks_per_node=2)
    assert out[:2] == ["torchrun", "--nnodes=3"] and out[6] == "/runs/r1/recover/plan-0001.yaml"
    assert launcher_of(None, cmd) == "torchrun" and launcher_of(None, ["sbatch", "x"]) == "slurm"


def test_every_flag_of_mscale_train_is_known_to_take_no_value():
    """The rewrite reads ``--option VALUE`` pairs: a train flag missing from the list would eat
    the next argument when the command is rewritten."""
    from mscale.cli.app import build
    from mscale.recover import command

    root = build()
    train = root.commands["train"]
    flags = {name for p in train.params if getattr(p, "is_flag", False)
             for name in [*p.opts, *p.secondary_opts]}
    assert flags and flags <= command.FLAGS_WITHOUT_VALUE, flags - command.FLAGS_WITHOUT_VALUE


def test_an_earlier_rollback_is_not_replayed_when_resuming_the_latest(tmp_path):
    """The last relaunch carried --resume RUN/ckpt/step-4; resumed from the latest now, it
    would roll back to step 4 again (review, helper-47). A foreign start path is left to train."""
    run = str(tmp_path / "run")
    argv = ["mscale", "train", "p.yaml", "--run-dir", run, "--resume", f"{run}/ckpt/step-000004"]
    out = rewrite_train(argv, Change(world=8, nodes=[], run_dir=run), local=False)
    assert out[-2:] == ["--resume", "auto"]
    other = ["mscale", "train", "p.yaml", "--run-dir", run, "--resume", "/data/base/ckpt/latest"]
    assert rewrite_train(other, Change(world=8, nodes=[], run_dir=run), local=False)[-1] == \
        "/data/base/ckpt/latest"


def test_a_relative_rollback_or_resume_none_is_not_replayed(tmp_path):
    """`--resume runs/r1/ckpt/step-000004` (relative to where the job ran) rolled the run back on
    every relaunch; `--resume none` made every relaunch refuse a run with checkpoints."""
    run = str(tmp_path / "runs" / "r1")
    change = Change(world=8, nodes=[], run_dir=run)
    rel = ["mscale", "train", "p.yaml", "--run-dir", "runs/r1", "--resume",
           "runs/r1/ckpt/step-000004"]
    assert rewrite_train(rel, change, local=False, cwd=str(tmp_path))[-2:] == ["--resume", "auto"]
    none = ["mscale", "train", "p.yaml", "--run-dir", "runs/r1", "--resume=none"]
    assert rewrite_train(none, change, local=False, cwd=str(tmp_path))[-1] == "--resume=auto"
