"""A written rank map is checked by topology, not by config's `load_plan`: the check re-derives
the placement, and config sits below topology (docs/architecture.md, "Layers"). Every command
that runs or reshards a plan file must therefore load it with `load_checked_plan`."""

from __future__ import annotations

import pytest
import yaml

from mscale.config.plan import load_plan
from mscale.errors import MscaleError
from mscale.topology.placement import load_checked_plan, placement_record
from tests.conftest import PLANS


def write_plan(tmp_path, edit=None) -> str:
    """cpu-tiny with its placement written out, as `mscale plan` does, then ``edit``-ed."""
    plan = load_plan(str(PLANS / "cpu-tiny.yaml"))
    data = plan.model_copy(update={"placement": placement_record(plan)}).model_dump(mode="json")
    if edit:
        edit(data["placement"])
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def swap_nodes(placement):
    """Ranks 0 and 7 trade nodes: still a well-formed map, no longer the layout's."""
    rows = placement["ranks"]
    rows[0][1], rows[7][1] = rows[7][1], rows[0][1]


def swap_tp_groups(placement):
    tp = placement["groups"]["tp"]
    tp[0], tp[1] = tp[1], tp[0]


@pytest.mark.parametrize("edit,field", [(swap_nodes, "placement.ranks"),
                                        (swap_tp_groups, "placement.groups")])
def test_a_hand_edited_map_is_refused(tmp_path, edit, field):
    path = write_plan(tmp_path, edit)
    with pytest.raises(MscaleError) as e:
        load_checked_plan(path)
    assert (e.value.field, e.value.file) == (field, path)


def test_node_names_that_are_not_the_hostlists_are_refused(tmp_path):
    """The hostlist edited by hand, the written names left: train and preflight named the
    nodes from the hostlist, recover from placement.nodes."""
    path = write_plan(tmp_path)
    data = yaml.safe_load(open(path))
    data["cluster"]["hostlist"] = "spare1,node[2-4]"
    open(path, "w").write(yaml.safe_dump(data))
    with pytest.raises(MscaleError) as e:
        load_checked_plan(path)
    assert (e.value.field, e.value.file) == ("placement.nodes", path)
    assert "node1, node2, node3 ... (4 in all)" in e.value.message and "spare1" in e.value.message
    del data["placement"]  # the fix the error gives: the placement is derived again
    open(path, "w").write(yaml.safe_dump(data))
    assert load_checked_plan(path).placement is None


def test_the_written_map_and_an_absent_one_load(tmp_path):
    assert load_checked_plan(write_plan(tmp_path)).placement is not None
    assert load_checked_plan(str(PLANS / "cpu-tiny.yaml")).placement is None


def test_the_probe_refuses_a_hand_edited_map(tmp_path):
    from mscale.topology.env import read_launch_env
    from mscale.topology.probe import probe

    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})
    with pytest.raises(MscaleError, match="placement.ranks does not match"):
        probe(write_plan(tmp_path, swap_nodes), env)


def test_train_refuses_a_hand_edited_map_before_any_worker(tmp_path):
    from mscale.train.launch import check_before_launch
    from mscale.train.options import TrainOptions

    with pytest.raises(MscaleError) as e:
        check_before_launch(write_plan(tmp_path, swap_nodes),
                            TrainOptions(run_dir=str(tmp_path / "run")), 8)
    assert e.value.field == "placement.ranks"


def test_ckpt_convert_refuses_a_hand_edited_target_plan(tmp_path):
    from mscale.ckpt.convert import convert

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(MscaleError) as e:
        convert(str(hf), str(tmp_path / "out"), plan=write_plan(tmp_path, swap_nodes))
    assert e.value.field == "placement.ranks"
