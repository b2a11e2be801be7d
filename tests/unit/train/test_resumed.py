"""What a resume says when the data or the learning-rate schedule differ from the checkpoint's."""

import pytest

from mscale.ckpt.manifest import TrainState
from mscale.config.training import TrainingConfig
from mscale.errors import MscaleError
from mscale.train.resumed import resume_notes
from mscale.train.schedule import learning_rate

CFG = TrainingConfig(global_batch=16, steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=4)
CKPT = "runs/r/ckpt/step-000010"


def _state(**kw):
    base = dict(step=10, samples=160, lr=learning_rate(CFG, 9), data_fingerprint=1234)
    base.update(kw)
    return TrainState.model_construct(**base)


def test_the_same_data_and_schedule_say_nothing():
    assert resume_notes(_state(), CFG, 1234, True, CKPT) == []


def test_changed_data_refuse_a_restart_naming_the_way_to_mean_it():
    with pytest.raises(MscaleError) as e:
        resume_notes(_state(), CFG, 999, True, CKPT)
    assert "differ from what runs/r/ckpt/step-000010 trained on" in str(e.value)
    assert "1234, now 999" in str(e.value)
    assert e.value.field == "training.data" and "--allow-data-change" in e.value.fix
    notes = resume_notes(_state(), CFG, 999, True, CKPT, data_change=True)
    assert len(notes) == 1 and "of the new data" in notes[0]


def test_changed_data_from_another_runs_checkpoint_are_one_line():
    notes = resume_notes(_state(), CFG, 999, False, CKPT)
    assert len(notes) == 1 and "continuing at global sample 160 of the new data" in notes[0]


def test_a_checkpoint_without_a_fingerprint_is_not_judged():
    """HF imports and manifests from before the field carry none."""
    assert resume_notes(_state(data_fingerprint=None), CFG, 999, True, CKPT) == []


def test_more_steps_make_the_learning_rate_jump_and_say_so():
    longer = CFG.model_copy(update={"steps": 40})
    notes = resume_notes(_state(), longer, 1234, True, CKPT)
    assert len(notes) == 1 and "the learning rate jumps: step 10 trained at" in notes[0]
    assert f"{learning_rate(longer, 10):.3g} next" in notes[0] and "(40 steps)" in notes[0]


def test_fewer_steps_than_the_checkpoint_has_say_nothing_of_the_learning_rate():
    """Nothing trains (the resume line says so): no jump to warn of."""
    shorter = CFG.model_copy(update={"steps": 8})
    assert resume_notes(_state(), shorter, 1234, True, CKPT) == []


def test_a_constant_schedule_past_warm_up_does_not_jump():
    flat = CFG.model_copy(update={"lr_schedule": "constant"})
    state = _state(lr=learning_rate(flat, 9))
    assert resume_notes(state, flat.model_copy(update={"steps": 40}), 1234, True, CKPT) == []


def test_a_checkpoint_of_the_runs_own_ckpt_folder_is_a_restart(tmp_path):
    """recover's rollback names one (--resume RUN/ckpt/step-N): still this run's restart."""
    from mscale.train.resumed import is_own
    root = str(tmp_path / "run" / "ckpt")
    assert is_own(f"{root}/step-000010", root) and is_own(f"file://{root}/step-000010", root)
    assert not is_own(str(tmp_path / "other" / "ckpt" / "step-000010"), root)
    assert not is_own(str(tmp_path / "run" / "ckpt2" / "step-000010"), root)
    assert is_own("s3://b/run/ckpt/step-000001", "s3://b/run/ckpt")
    assert not is_own("s3://b/run2/ckpt/step-000001", "s3://b/run/ckpt")
