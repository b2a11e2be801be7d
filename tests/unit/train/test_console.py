"""train/console.py: the lines an operator reads."""

from __future__ import annotations

from mscale.train.console import resume_text


def test_a_resume_from_an_hf_import_at_step_0_is_said():
    """An HF-imported checkpoint is step 0: the line follows what was loaded, not its step."""
    line = resume_text("runs/r/ckpt/step-00000000", 0, 40)
    assert line == "resumed from runs/r/ckpt/step-00000000 (step 0); continuing to step 40"


def test_a_resume_from_a_later_step_and_a_fresh_start():
    assert resume_text("R/ckpt/step-00000010", 10, 40).startswith("resumed from R/ckpt/step-")
    assert "nothing to train" in resume_text("R/ckpt/step-00000040", 40, 40)
    assert resume_text(None, 0, 40) is None  # nothing loaded: a fresh run says nothing
