"""Checkpoint options are declared once (CkptOptions), travel inside TrainOptions to the workers,
and resolve the save interval from the command line, the plan's setting or its advice."""

from __future__ import annotations

from mscale.ckpt.options import CkptOptions
from mscale.config.plan import CheckpointAdvice
from mscale.train.options import TrainOptions
from tests.unit.ckpt.helpers import plan


def test_train_options_carry_the_checkpoint_options_through_the_launchers_json():
    sent = TrainOptions(run_dir="runs/x", ckpt=CkptOptions(interval=7, keep=2, level=0,
                                                           final=False, resume="none",
                                                           chunk_bytes=1 << 16))
    received = TrainOptions.model_validate_json(sent.model_dump_json())
    assert received == sent and isinstance(received.ckpt, CkptOptions)


def test_interval_precedence_option_then_plan_setting_then_advice():
    with_setting = plan(checkpoint_interval=40)
    assert CkptOptions(interval=5).interval_for(with_setting) == 5
    assert CkptOptions().interval_for(with_setting) == 40
    assert CkptOptions().interval_for(plan()) is None  # no setting, no advice recorded
    advice = CheckpointAdvice(interval_steps=30, interval_s=900.0, mtbf_h=10.0,
                              checkpoint_cost_s=1.0, restart_s=60.0, effective_training=0.9)
    assert CkptOptions().interval_for(plan().model_copy(update={"checkpoint": advice})) == 30


def test_codec_follows_the_level():
    assert CkptOptions(level=0).codec == "raw" and CkptOptions(level=3).codec == "zstd"

