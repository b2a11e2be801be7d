"""What a resume says when the data or the learning-rate schedule differ from the checkpoint's."""

import pytest

from mscale.ckpt.manifest import TrainState
from mscale.config.training import DataConfig, TrainingConfig
from mscale.errors import MscaleError
from mscale.train.data import DataIdentity
from mscale.train.resumed import resume_notes
from mscale.train.schedule import learning_rate

CFG = TrainingConfig(global_batch=16, steps=20, lr=3e-3, min_lr=3e-4, warmup_steps=4)
CKPT = "runs/r/ckpt/step-000010"


def _state(**kw):
    base = dict(step=10, samples=160, lr=learning_rate(CFG, 9), data_fingerprint=1234)
    base.update(kw)
    return TrainState.model_construct(**base)


def test_the_same_data_and_schedule_say_nothing():
    assert resume_notes(_state(), CFG, DataIdentity(1234), True, CKPT) == []


def test_changed_data_refuse_a_restart_naming_the_way_to_mean_it():
    with pytest.raises(MscaleError) as e:
        resume_notes(_state(), CFG, DataIdentity(999), True, CKPT)
    assert "differ from what runs/r/ckpt/step-000010 trained on" in str(e.value)
    assert "1234, now 999" in str(e.value)
    assert e.value.field == "training.data" and "--allow-data-change" in e.value.fix
    notes = resume_notes(_state(), CFG, DataIdentity(999), True, CKPT, data_change=True)
    assert len(notes) == 1 and "of the new data" in notes[0]


def test_changed_data_from_another_runs_checkpoint_are_one_line():
    notes = resume_notes(_state(), CFG, DataIdentity(999), False, CKPT)
    assert len(notes) == 1 and "continuing at global sample 160 of the new data" in notes[0]


def test_a_checkpoint_without_a_fingerprint_is_not_judged():
    """HF imports and manifests from before the field carry none."""
    assert resume_notes(_state(data_fingerprint=None), CFG, DataIdentity(999), True, CKPT) == []


def test_more_steps_make_the_learning_rate_jump_and_say_so():
    longer = CFG.model_copy(update={"steps": 40})
    notes = resume_notes(_state(), longer, DataIdentity(1234), True, CKPT)
    assert len(notes) == 1 and "the learning rate jumps: step 10 trained at" in notes[0]
    assert f"{learning_rate(longer, 10):.3g} next" in notes[0] and "(40 steps)" in notes[0]


def test_fewer_steps_than_the_checkpoint_has_say_nothing_of_the_learning_rate():
    """Nothing trains (the resume line says so): no jump to warn of."""
    shorter = CFG.model_copy(update={"steps": 8})
    assert resume_notes(_state(), shorter, DataIdentity(1234), True, CKPT) == []


def test_a_constant_schedule_past_warm_up_does_not_jump():
    flat = CFG.model_copy(update={"lr_schedule": "constant"})
    state = _state(lr=learning_rate(flat, 9))
    longer = flat.model_copy(update={"steps": 40})
    assert resume_notes(state, longer, DataIdentity(1234), True, CKPT) == []


def test_a_checkpoint_of_the_runs_own_ckpt_folder_is_a_restart(tmp_path):
    """recover's rollback names one (--resume RUN/ckpt/step-N): still this run's restart."""
    from mscale.train.resumed import is_own
    root = str(tmp_path / "run" / "ckpt")
    assert is_own(f"{root}/step-000010", root) and is_own(f"file://{root}/step-000010", root)
    assert not is_own(str(tmp_path / "other" / "ckpt" / "step-000010"), root)
    assert not is_own(str(tmp_path / "run" / "ckpt2" / "step-000010"), root)
    assert is_own("s3://b/run/ckpt/step-000001", "s3://b/run/ckpt")
    assert not is_own("s3://b/run2/ckpt/step-000001", "s3://b/run/ckpt")


def _source(path, digest="0" * 16, weight=1.0, tokens=1000, documents=10, role="train"):
    return {"path": path, "role": role, "weight": weight, "kind": "manifest", "digest": digest,
            "tokens": tokens, "documents": documents}


BLEND = [_source("src_a"), _source("src_b", "1" * 16, weight=3.0)]
TOKENS = CFG.model_copy(update={"data": DataConfig(sources=[
    {"path": "src_a"}, {"path": "src_b", "weight": 3.0}], eval_fraction=0.05)})


def test_a_re_prepared_source_is_named_even_when_sample_zero_is_the_same():
    """The user's case: sample 0 came from src_b, src_a was re-prepared with fewer documents."""
    now = DataIdentity(1234, [_source("src_a", "f" * 16, tokens=600, documents=6), BLEND[1]])
    state = _state(data_sources=BLEND)
    with pytest.raises(MscaleError) as e:
        resume_notes(state, TOKENS, now, True, CKPT)
    assert "src_a was re-prepared or changed (10 -> 6 documents, 1,000 -> 600 tokens)" \
        in e.value.message and "src_b" not in e.value.message
    assert "--allow-data-change" in e.value.fix
    notes = resume_notes(state, TOKENS, now, True, CKPT, data_change=True)
    assert "src_a was re-prepared" in notes[0] and "of the new data" in notes[0]
    assert "held-out" in notes[1] and "not comparable" in notes[1]


def test_weights_and_sources_added_or_removed_are_said_as_such():
    now = DataIdentity(1234, [_source("src_a", weight=2.0), _source("src_c")])
    notes = resume_notes(_state(data_sources=BLEND), TOKENS, now, False, CKPT)
    assert "src_a's weight changed from 1 to 2" in notes[0]
    assert "src_b was removed (weight 3)" in notes[0] and "src_c was added (weight 1)" in notes[0]


def test_a_source_spelled_another_way_on_resume_is_the_same_source(tmp_path, monkeypatch):
    """The checkpoint recorded ./src_a and src_b/ as the run named them; a resume naming them
    src_a and by absolute path was refused as changed data (src_a removed, added...)."""
    monkeypatch.chdir(tmp_path)
    saved = [_source("./src_a"), _source("src_b/", "1" * 16, weight=3.0)]
    now = DataIdentity(1234, [_source("src_a"), _source(f"{tmp_path}/src_b", "1" * 16,
                                                         weight=3.0)])
    assert resume_notes(_state(data_sources=saved), TOKENS, now, True, CKPT) == []
    other = DataIdentity(1234, [_source("src_c"), now.sources[1]])  # another place: refused
    with pytest.raises(MscaleError, match="./src_a was removed"):
        resume_notes(_state(data_sources=saved), TOKENS, other, True, CKPT)


def test_a_checkpoint_without_source_records_falls_back_to_the_first_sample():
    now = DataIdentity(999, BLEND)
    with pytest.raises(MscaleError, match="first sample's checksum 1234, now 999"):
        resume_notes(_state(), TOKENS, now, True, CKPT)
    assert resume_notes(_state(), TOKENS, DataIdentity(1234, BLEND), True, CKPT) == []


def test_the_train_state_keeps_the_source_records():
    state = TrainState(step=1, samples=16, data_fingerprint=7, data_sources=BLEND)
    assert state.data_fingerprint == 7 and [r.path for r in state.data_sources] == ["src_a",
                                                                                     "src_b"]


def test_the_same_sources_with_another_first_sample_still_say_the_data_changed():
    """eval_fraction, the seed or seq_len changed: no source differs, the order does."""
    with pytest.raises(MscaleError, match="every source is as it was, but the first sample"):
        resume_notes(_state(data_sources=BLEND), TOKENS, DataIdentity(999, BLEND), True, CKPT)


def test_a_model_changed_in_a_field_that_keeps_shapes_is_said():
    from mscale.config.model import ModelConfig
    from mscale.train.resumed import model_note

    saved = ModelConfig(layers=2, hidden=64, heads=4, vocab=256, seq_len=64)
    now = saved.model_copy(update={"rope_theta": 500000.0, "norm_eps": 1e-6, "name": "other"})
    note = model_note(saved.model_dump(mode="json"), now, CKPT)
    assert note.startswith(f"the model differs from the one {CKPT} trained: ")
    assert "rope_theta 10000.0 -> 500000.0" in note and "norm_eps 1e-05 -> 1e-06" in note
    assert "name" not in note.split(": ", 1)[1]  # a new name is no change of model
    assert model_note(saved.model_dump(mode="json"), saved, CKPT) is None
    assert model_note(None, saved, CKPT) is None  # a manifest without a model section


def test_a_checkpoint_of_more_blocks_than_the_model_is_refused_before_any_worker():
    """4 blocks resumed into a 2-block model loaded (the loader reads what the model asks for)
    and trained a truncated model with one note (helper-46)."""
    from types import SimpleNamespace

    from mscale.config.plan import load_plan
    from mscale.errors import MscaleError
    from mscale.train.launch import check_no_layer_dropped
    from tests.conftest import PLANS

    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))  # 4 blocks
    more = SimpleNamespace(plan={"model": {"layers": 6}})
    with pytest.raises(MscaleError, match="holds 6 blocks, this plan's model 4: blocks 4-5") as e:
        check_no_layer_dropped(more, plan, "p.yaml", "other/ckpt/latest")
    assert e.value.field == "model.layers" and e.value.file == "p.yaml"
    check_no_layer_dropped(SimpleNamespace(plan={"model": {"layers": 4}}), plan, "p", "auto")
    check_no_layer_dropped(None, plan, "p", "auto")  # a fresh run
