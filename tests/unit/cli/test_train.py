"""``mscale train`` without a launcher, and a worker's failure line naming the launcher's node:
in-process, no job is started."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PLANS

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MSCALE_TRAIN_OPTIONS")


def test_train_without_a_launcher_is_a_plain_bad_input_error(cli, tmp_path, monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    run = tmp_path / "run"
    code, out, err = cli("train", str(PLANS / "cpu-tiny.yaml"), "--run-dir", str(run))
    assert code == 3, out + err
    assert err.startswith("error: no launcher environment found") and "Traceback" not in err
    # no rank or host before a launcher exists: not "error (rank -1 on <host>, bad_input)"
    assert "rank -1" not in err and "bad_input" not in err
    assert "mscale train PLAN --run-dir DIR --local 8" in err  # the plan's 8 processes
    assert not (run / "logs").exists()  # no error file of a rank that never was


def test_a_checkpoint_given_as_the_run_directory_is_refused_before_any_start(cli, tmp_path):
    """An HF import (`ckpt convert HF DST --plan P`) is a checkpoint: training "in" it would
    start from scratch beside its unread weights."""
    ckpt = tmp_path / "imported"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    (ckpt / "COMMITTED").write_text("{}")
    code, out, err = cli("train", str(PLANS / "cpu-tiny.yaml"), "--run-dir", str(ckpt),
                         "--local", "8")
    assert code == 3, out + err
    assert err.startswith(f"error: --run-dir: {ckpt} is a checkpoint"), err
    assert f"fix: to train from it: --resume {ckpt} with a new --run-dir" in err
    assert sorted(p.name for p in ckpt.iterdir()) == ["COMMITTED", "manifest.json"]


def test_a_workers_failure_names_the_plans_node_under_local(tmp_path, monkeypatch, capsys):
    """Under --local the launcher says `rank 3 on node2`; the worker's own line and error file
    say the same, not this machine's host name."""
    import mscale.distributed.init as init
    import mscale.train.loop as loop
    from mscale.topology.env import read_launch_env
    from mscale.topology.placement import load_checked_plan
    from mscale.train.options import TrainOptions
    from mscale.train.worker import run_worker

    class Exited(Exception):
        pass

    def exit_with(code, barrier=True):
        raise Exited(code)

    def crash(plan, options, env):
        raise KeyError("pp")

    monkeypatch.setattr(init, "shutdown_and_exit", exit_with)
    monkeypatch.setattr(loop, "train", crash)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # leave this test process's threads alone
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MSCALE_LAUNCHER": "local"})
    plan = load_checked_plan(str(PLANS / "cpu-tiny.yaml"))
    with pytest.raises(Exited) as e:
        run_worker(plan, TrainOptions(run_dir=str(tmp_path)), env)
    assert e.value.args == (3,)
    assert "error (rank 3 on node2, crash)" in capsys.readouterr().err
    assert json.loads((tmp_path / "logs" / "rank3.error.json").read_text())["node"] == "node2"


def test_every_option_is_one_field_whose_docstring_is_the_flags_help(cli):
    """TrainOptions (with its CkptOptions and FaultPlan) is where a flag is declared: each field
    marked as a flag is an option of `mscale train`, its help is the field's docstring, and the
    test hooks are hidden."""
    from mscale.cli.options import flags
    from mscale.train.options import TrainOptions

    code, out, _ = cli("train", "--help")
    assert code == 0
    text = " ".join(out.replace("│", " ").split())
    declared = flags(TrainOptions)
    assert {f.flag for f in declared} >= {"--steps", "--timeout", "--resume", "--zstd-level",
                                          "--final-ckpt", "--inject-crash", "--inject-ckpt-kill"}
    for f in declared:
        hidden = f.extra.get("hidden", False)
        assert (f.flag in text) != hidden, f.flag
        if not hidden:
            assert " ".join(f.info.description.split())[:40] in text, f.flag
    assert "--ckpt-level" not in text  # no second spelling of --zstd-level


def test_flag_values_become_the_options_fields_and_refusals_name_the_flag():
    from mscale.cli.options import build
    from mscale.errors import MscaleError
    from mscale.train.options import TrainOptions

    opts = build(TrainOptions, {"steps": 5, "ckpt__level": 0, "ckpt__final": False,
                                "faults__delay": ["1:0.5"]}, run_dir="r")
    assert (opts.steps, opts.ckpt.level, opts.ckpt.final, opts.faults.delay) == (5, 0, False,
                                                                                  {1: 0.5})
    for values, flag in (({"timeout_s": 0.0}, "--timeout"), ({"trace_ranks": "x"}, "--trace-ranks"),
                         ({"ckpt__keep": 0}, "--ckpt-keep"), ({"faults__nan_step": 0},
                                                              "--inject-nan")):
        with pytest.raises(MscaleError) as e:
            build(TrainOptions, values, run_dir="r")
        assert e.value.field == flag


@pytest.mark.parametrize("command", ["train", "preflight"])
def test_a_local_count_against_a_cluster_plan_names_srun_not_12288_processes(cli, tmp_path,
                                                                             command):
    """The README's `plan -o run.yaml` for 12,288 GPUs, tried with --local 8: the fix said
    `use --local 12288`, which preflight would have started on this machine. A CPU plan's fix
    still names its own count."""
    plan = tmp_path / "run.yaml"
    code, _, err = cli("plan", "--cluster", str(PLANS / "clusters" / "a100-12288.yaml"),
                       "--model", str(PLANS / "models" / "gpt-175b.yaml"), "--training",
                       str(PLANS / "training" / "gpt-175b.yaml"), "-o", str(plan))
    assert code == 0, err
    code, out, err = cli(command, str(plan), "--run-dir", str(tmp_path / "r"), "--local", "8")
    assert code == 3 and "but the plan's layout needs 12288 processes" in err, out + err
    assert "fix: run it on its 1536 nodes under srun or torchrun" in err and "12288," not in err
    code, out, err = cli(command, str(PLANS / "cpu-tiny.yaml"), "--run-dir",
                         str(tmp_path / "c"), "--local", "4")
    assert code == 3 and "fix: use --local 8, or plan for 4 processes" in err, out + err
