"""A field spelt right in the wrong section of a plan: the error names where it belongs."""

from __future__ import annotations

import pytest
import yaml

from mscale.config import load_plan
from mscale.errors import MscaleError

from tests.conftest import PLANS


@pytest.mark.parametrize("move, field, home", [
    (("training", "layout", "sequence_parallel"), "training.sequence_parallel",
     "layout.sequence_parallel"),
    (("layout", "training", "seed"), "layout.seed", "training.seed"),
    (("training", "model", "seq_len"), "training.seq_len", "model.seq_len"),
])
def test_a_field_in_the_wrong_section_names_the_section_it_belongs_in(tmp_path, move, field,
                                                                      home):
    """`sequence_parallel: true` written under a plan's training: (beside micro_batch and
    recompute, which are there) was "unknown field (a typo?)", fix "correct the field": the
    spelling is right, the place is wrong, and the error now says where it goes."""
    plan = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    into, source, name = move
    plan[into][name] = plan[source][name]  # written twice: the right one stays
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    with pytest.raises(MscaleError) as e:
        load_plan(str(f))
    assert e.value.field == field
    assert e.value.message == f"not a field of this section (it goes at {home})"
    assert e.value.fix.startswith(f"move it to {home};")


def test_a_section_whose_field_of_that_name_cannot_take_the_value_is_not_offered(tmp_path):
    """`tp: 2` under training went "at layout.tp or placement.groups.tp": the placement's tp is
    the list of TP groups' ranks that `mscale plan` writes, where a 2 is refused in turn."""
    plan = yaml.safe_load((PLANS / "cpu-tiny.yaml").read_text())
    plan["training"]["tp"] = plan["layout"]["tp"]
    f = tmp_path / "plan.yaml"
    f.write_text(yaml.safe_dump(plan))
    with pytest.raises(MscaleError) as e:
        load_plan(str(f))
    assert e.value.message == "not a field of this section (it goes at layout.tp)"


@pytest.mark.parametrize("text, field, message, fix", [
    ("global_batch: 16\ntp: 2\n", "tp",
     "not a field of a training file: tp is a layout choice",
     "give it to plan as --tp, or in a plan's layout section (layout.tp)"),
    ("global_batch: 16\nsequence_parallel: true\n", "sequence_parallel",
     "not a field of a training file: sequence_parallel is a layout choice",
     "give it to plan as --sp, or in a plan's layout section (layout.sequence_parallel)"),
    ("global_batch: 16\nseq_len: 64\n", "seq_len",
     "not a field of a training file: it belongs in the model file",
     "move it to the file given as --model (model.seq_len in a plan)"),
])
def test_a_training_file_names_where_a_field_of_another_section_goes(tmp_path, text, field,
                                                                     message, fix):
    """A training file given alone to `mscale plan --training` with `tp: 2` said "unknown field
    (a typo?)", fix "correct the field": there is no plan around it to name the section in."""
    from mscale.config import TrainingConfig
    from mscale.planner.choose import load_part

    f = tmp_path / "part.yaml"
    f.write_text(text)
    with pytest.raises(MscaleError) as e:
        load_part(TrainingConfig, str(f), "--training")
    assert (e.value.field, e.value.message, e.value.fix) == (field, message, fix)
