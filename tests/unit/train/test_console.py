"""train/console.py: the lines an operator reads."""

from __future__ import annotations

from mscale.train.console import resume_text


def test_a_resume_from_an_hf_import_at_step_0_is_said():
    """An HF-imported checkpoint is step 0: the line follows what was loaded, not its step."""
    line = resume_text("runs/r/ckpt/step-00000000", 0, 40)
    assert line == "resumed from runs/r/ckpt/step-00000000 (step 0); continuing to step 40"


def test_a_resume_from_a_later_step_and_a_fresh_start():
    assert resume_text("R/ckpt/step-00000010", 10, 40).startswith("resumed from R/ckpt/step-")
    assert "is 40 and the run is already at step 40, nothing to train" in \
        resume_text("R/ckpt/step-00000040", 40, 40)
    assert resume_text("R/ckpt/step-00000060", 60, 40).startswith(
        "resumed from R/ckpt/step-00000060 (step 60): training.steps is 40 and the run is "
        "already past step 40, nothing to train")
    assert resume_text(None, 0, 40) is None  # nothing loaded: a fresh run says nothing


def test_another_runs_checkpoint_at_the_end_is_not_told_to_use_a_new_run_dir():
    """`--resume OTHER/ckpt/step-N` into a new run directory with --steps N: that directory is
    already new, so the way to start over is to leave out --resume."""
    own = resume_text("R/ckpt/step-000040", 40, 40)
    assert own.endswith("nothing to train (raise --steps, or use a new --run-dir to start over)")
    other = resume_text("OTHER/ckpt/step-000040", 40, 40, own=False)
    assert other.endswith("nothing to train (raise --steps, or leave out --resume to train "
                          "this run from step 0)"), other


def _record(step: int, seconds: float, mfu: float):
    from mscale.config.records import MetricsRecord

    return MetricsRecord(step=step, time=0.0, loss=2.0, grad_norm=1.0, clip_threshold=1.0,
                         lr=1e-4, tokens=1000, tokens_per_s=1000 / seconds, mfu=mfu,
                         step_time=[seconds], compute_time=[seconds], comm_wait=[0.0],
                         data_time=[0.0], bubble_time=[0.0])


def test_the_summary_speed_leaves_out_the_first_step_that_built_kernels():
    """A compiled run's first step compiles for a minute: the closing figures are the steady
    state after it, and the line says which step was left out and why."""
    from mscale.train.console import Summary

    s = Summary(first_step=10)
    for step, seconds, mfu in [(11, 60.0, 0.01), (12, 0.5, 0.4), (13, 0.5, 0.5)]:
        s.add(_record(step, seconds, mfu))
    d = s.as_dict()
    assert d["tokens_per_s"] == 2000 and d["mfu"] == 0.45 and d["first_step_s"] == 60.0
    line = s.line(None, "R")
    assert line.startswith("steps 11-13, final loss 2.0000, 2,000 tokens/s, MFU 45.0% "
                           "(step 11 left out: 60.0 s of warm-up)")


def test_a_summary_of_one_step_or_of_even_steps_says_no_warm_up():
    from mscale.train.console import Summary

    one = Summary(first_step=0)
    one.add(_record(1, 2.0, 0.3))
    assert one.as_dict()["tokens_per_s"] == 500 and one.as_dict()["mfu"] == 0.3
    even = Summary(first_step=0)
    for step in (1, 2, 3):
        even.add(_record(step, 1.0, 0.3))
    assert "left out" not in even.line(None, "R") and "left out" not in one.line(None, "R")


def test_checkpoint_events_reach_the_console():
    """A commit says its size and cost; a failed save, which used to reach only events.jsonl,
    says what failed and what happens next; other events print nothing."""
    from mscale.train.console import checkpoint_line

    line = checkpoint_line("checkpoint", "checkpoint step-000010 committed (interval)",
                           {"stored_bytes": 3.2e9, "total_s": 41.0, "blocking_s_max": 0.31})
    assert line == ("checkpoint step-000010 committed (interval): 3.2 GB; 41.0 s in the "
                    "background; training blocked 0.31 s")
    failed = checkpoint_line("checkpoint_failed", "checkpoint step-000010 failed on 2 rank(s): "
                             "OSError: No space left; training continues, latest stays "
                             "step-000005", {})
    assert failed.startswith("WARNING checkpoint step-000010 failed") and "latest stays" in failed
    assert checkpoint_line("info", "resumed from x", {}) is None
    kept = checkpoint_line("info", "checkpoint step-000010 committed, but deleting older "
                           "checkpoints (retention) failed; ...", {"retention_error": "OSError"})
    assert kept.startswith("WARNING checkpoint step-000010 committed, but deleting older")
    assert checkpoint_line("checkpoint", "checkpoint step-000001 committed (final)", {}) == \
        "checkpoint step-000001 committed (final)"


def test_a_rollback_says_where_the_newer_checkpoints_went():
    from mscale.train.console import moved_aside_line

    cleaned = ["removed step-000012 (never committed)",
               "moved step-000010 to abandoned-step-000010-17 (newer than the resume point)"]
    line = moved_aside_line(cleaned, "runs/r/ckpt")
    assert line.startswith("moved step-000010 to abandoned-step-000010-17")
    assert "runs/r/ckpt" in line and "ckpt ls" in line and "removed" not in line
    assert moved_aside_line(cleaned[:1], "runs/r/ckpt") is None


def test_the_start_line_counts_processes_in_the_right_number():
    """--local 1 said 'training cpu-tiny: tp1·pp1·dp1 on 1 processes'."""
    from mscale.topology.placement import load_checked_plan
    from mscale.train.console import start_line
    from tests.conftest import PLANS

    plan = load_checked_plan(str(PLANS / "cpu-tiny.yaml"))
    assert " on 1 process (local, cpu), " in start_line(plan, 1, "local", "r", "id", 1, "cpu")
    assert " on 8 processes (local, cpu), " in start_line(plan, 8, "local", "r", "id", 1, "cpu")
