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
