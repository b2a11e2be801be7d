"""A run directory keeps one model and recipe; a new layout is accepted and recorded."""

import uuid

import pytest

from mscale.config.base import dump_yaml, load_model
from mscale.config.plan import Plan, load_plan
from mscale.errors import EXIT_BAD_INPUT, MscaleError
from mscale.config.records import Event
from mscale.runs.history import (PlanChange, check_plan_change, describe_layout, plan_change_of,
                                 plan_history, write_plan)
from mscale.runs.rundir import RunDir
from tests.conftest import PLANS


def _plan(**sections) -> Plan:
    """The CPU demo plan with some sections' fields replaced, e.g. layout={"tp": 1, "dp": 4}."""
    data = load_plan(str(PLANS / "cpu-tiny.yaml")).model_dump(mode="json", exclude_none=True)
    for section, fields in sections.items():
        if isinstance(fields, dict):
            data[section] = {**data[section], **fields}
        else:
            data[section] = fields
    return Plan.model_validate(data)


def test_identical_plans_are_no_change():
    change = check_plan_change(_plan(), _plan(estimate={"mfu": 0.5}))
    assert change.kind == "same" and change.fields == ()


def test_a_new_layout_on_fewer_nodes_is_accepted_and_described():
    old = _plan()
    new = _plan(layout={"tp": 2, "pp": 2, "dp": 1},
                cluster={"hostlist": "node[1-2]", "nodes": 2}, training={"lr": 1e-3})
    change = check_plan_change(old, new)
    assert change.kind == "changed" and change.relayout
    assert change.old_layout == "tp2 pp2 dp2 on 4 nodes (cpu-4x2)"
    assert change.new_layout == "tp2 pp2 dp1 on 2 nodes (cpu-4x2)"
    assert "layout.dp" in change.fields and "cluster.hostlist" in change.fields
    assert "training.lr" in change.fields and "training.lr" in change.message()


def test_one_node_is_not_nodes():
    one = _plan(layout={"tp": 2, "pp": 2, "dp": 1}, cluster={"hostlist": "node1", "nodes": 1,
                                                             "gpus_per_node": 4})
    assert describe_layout(one).endswith("on 1 node (cpu-4x2)")


@pytest.mark.parametrize("section,fields,named", [
    ("model", {"layers": 6}, "model.layers"),
    ("model", {"seq_len": 128}, "model.seq_len"),
    ("training", {"seed": 7}, "training.seed"),
    ("training", {"optimizer": "lamb"}, "training.optimizer"),
    ("training", {"data": {"kind": "tokens", "path": "t.bin"}}, "training.data.kind"),
])
def test_another_model_or_recipe_is_refused(section, fields, named):
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(), _plan(**{section: fields}), source="RUN/plan.yaml")
    err = info.value
    assert err.code == EXIT_BAD_INPUT and err.field == named and named in err.message
    assert err.file == "RUN/plan.yaml" and "--run-dir" in err.fix


def test_a_new_global_batch_needs_permission():
    """Refused by default with the flag that allows it as the fix; allowed, it is a change like
    any other, and only the batch: a new seed is still another recipe."""
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(), _plan(training={"global_batch": 32}), source="RUN/plan.yaml")
    err = info.value
    assert err.code == EXIT_BAD_INPUT and err.field == "training.global_batch"
    assert "--allow-batch-change" in err.fix and "16 -> 32" in err.message
    change = check_plan_change(_plan(), _plan(training={"global_batch": 32}),
                               allow_batch_change=True)
    assert change.kind == "changed" and change.fields == ("training.global_batch",)
    with pytest.raises(MscaleError, match="another model or training recipe"):
        check_plan_change(_plan(), _plan(training={"global_batch": 32, "seed": 7}),
                          allow_batch_change=True)


def test_a_new_data_mixture_needs_permission():
    """A curriculum step (new sources or weights) is refused by default, naming the flag;
    allowed, it is a change like any other, and only the data: a new seed is still refused."""
    data = {"data": {"kind": "tokens", "path": "t.bin"}}
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(), _plan(training=data), source="RUN/plan.yaml")
    assert "--allow-data-change" in info.value.fix
    change = check_plan_change(_plan(), _plan(training=data), allow_data_change=True)
    assert change.kind == "changed" and all(f.startswith("training.data.") for f in change.fields)
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(), _plan(training={**data, "seed": 7}), allow_data_change=True)
    assert info.value.field == "training.seed" and "--allow-data-change" not in info.value.fix


def test_how_data_is_read_is_not_what_is_read():
    """read_ahead and remote_retry_s change no sample: a resume may retune them, and a run
    directory's plan from before remote_retry_s existed (no such key) is no data change."""
    old = _plan().model_dump(mode="json", exclude_none=True)
    del old["training"]["data"]["remote_retry_s"]
    new = _plan(training={"data": {"read_ahead": 8, "remote_retry_s": 300}})
    change = check_plan_change(Plan.model_validate(old), new)
    assert change.kind == "changed" and set(change.fields) <= {
        "training.data.read_ahead", "training.data.remote_retry_s"}


def test_renaming_the_model_is_not_a_new_model():
    change = check_plan_change(_plan(), _plan(model={"name": "tiny-v2"}))
    assert change.kind == "changed" and change.fields == ("model.name",) and not change.relayout


def record_plan(run: RunDir, plan: Plan) -> PlanChange:
    """What train's claim does with a plan: judge it (raising if refused, before any write),
    then keep it unless it is the same."""
    change = plan_change_of(run, plan)
    return change if change.kind == "same" else write_plan(run, plan, change)


def trained(run: RunDir) -> None:
    """A step's metrics record: from now on the run's model and recipe are fixed."""
    run.append_record(run.metrics, Event(source="train", kind="info", message="a step"))


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_write_plan_keeps_every_plan_and_a_refused_one_writes_nothing(tmp_path, proto):
    root = str(tmp_path / "run") if proto == "file" else f"memory://hist-{uuid.uuid4().hex}/run"
    run = RunDir(root)
    first, second = _plan(), _plan(layout={"dp": 1}, cluster={"hostlist": "node[1-2]", "nodes": 2})
    assert record_plan(run, first).kind == "new"
    assert record_plan(run, first).kind == "same"
    assert [u.rsplit("/", 1)[-1] for u in plan_history(run)] == ["plan-0001.yaml"]
    trained(run)
    change = record_plan(run, second)
    assert change.kind == "changed" and change.history.endswith("plans/plan-0002.yaml")
    assert load_model(Plan, run.plan) == second
    assert load_model(Plan, plan_history(run)[0]) == first
    with pytest.raises(MscaleError, match="model.hidden"):
        record_plan(run, _plan(model={"hidden": 128}))
    assert load_model(Plan, run.plan) == second and len(plan_history(run)) == 2


def test_a_run_directory_from_before_the_history_keeps_its_plan(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.create()
    old_text = dump_yaml(_plan())
    (tmp_path / "run" / "plan.yaml").write_text(old_text)  # written by an older mscale
    record_plan(run, _plan(layout={"tp": 1, "dp": 4}))
    names = [u.rsplit("/", 1)[-1] for u in plan_history(run)]
    assert names == ["plan-0001.yaml", "plan-0002.yaml"]
    assert (tmp_path / "run" / "plans" / "plan-0001.yaml").read_text() == old_text


def test_a_refused_blend_change_shows_the_difference_not_a_truncated_list():
    """The user's trial truncated both lists before they differed."""
    old = {"data": {"kind": "tokens", "sources": [{"path": "src_a", "weight": 3.0},
                                                  {"path": "src_b", "weight": 1.0}]}}
    new = {"data": {"kind": "tokens", "sources": [{"path": "src_a", "weight": 3.0},
                                                  {"path": "src_b", "weight": 2.0},
                                                  {"path": "src_c", "weight": 1.0}]}}
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(training=old), _plan(training=new), source="RUN/plan.yaml")
    assert ("training.data.sources: src_b weight 1 -> 2; src_c added (weight 1)"
            in info.value.message) and "..." not in info.value.message
    assert "--allow-data-change" in info.value.fix


@pytest.mark.parametrize("before, after", [
    ("./data/x", "data/x"), ("data/x/", "data/x"), ("data/x", "{cwd}/data/x"),
    ("data/x", "file://{cwd}/data/x"), ("s3://bucket/x/", "s3://bucket/x")])
def test_a_source_spelled_another_way_is_the_same_recipe(tmp_path, monkeypatch, before, after):
    """A resume naming a source as ./data/x (or with a trailing slash, or its absolute path)
    where the run wrote data/x was refused as 'another model or training recipe'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "x").mkdir(parents=True)
    after = after.format(cwd=tmp_path)
    for field in ("path", "sources"):
        def data(p):
            return {"kind": "tokens", field: p if field == "path" else [
                {"path": "data/y", "weight": 2.0}, {"path": p}]}
        change = check_plan_change(_plan(training={"data": data(before)}),
                                   _plan(training={"data": data(after)}))
        assert change.kind == "same", (field, change.fields)


@pytest.mark.parametrize("before, after", [
    ("data/x", "data/y"), ("data/x", "data/x/sub"), ("s3://bucket/x", "s3://bucket/y"),
    ("s3://bucket/x", "s3://other/x")])
def test_another_location_is_still_another_recipe(tmp_path, monkeypatch, before, after):
    monkeypatch.chdir(tmp_path)
    old = {"data": {"kind": "tokens", "sources": [{"path": before}]}}
    new = {"data": {"kind": "tokens", "sources": [{"path": after}]}}
    with pytest.raises(MscaleError) as info:
        check_plan_change(_plan(training=old), _plan(training=new), source="RUN/plan.yaml")
    assert f"{after} added (weight 1); {before} removed" in info.value.message


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_a_plan_no_step_trained_with_is_replaced_not_refused(tmp_path, proto):
    """A first start writes plan.yaml at its claim (recover reads it) and may fail before step 1:
    a model that does not fit, a data path found wrong on the nodes. The fixed plan was refused
    as "another model or training recipe ... its checkpoints would be meaningless" in a run
    directory with no checkpoint and no step. Once a step has trained, it is refused again."""
    from mscale.runs.history import has_trained

    root = str(tmp_path / "run") if proto == "file" else f"memory://hist-{uuid.uuid4().hex}/run"
    run = RunDir(root)
    run.create()
    first, fixed = _plan(), _plan(model={"hidden": 128})
    write_plan(run, first, plan_change_of(run, first))
    run.append_record(run.events, Event(source="train", kind="stop", message="failed"))
    assert not has_trained(run)
    change = plan_change_of(run, fixed)
    assert change.kind == "changed" and change.untrained and "model.hidden" in change.fields
    assert plan_change_of(run, first).kind == "same"
    trained(run)
    assert has_trained(run)
    with pytest.raises(MscaleError, match="model.hidden"):
        plan_change_of(run, fixed)


def test_a_checkpoint_alone_counts_as_trained(tmp_path):
    """A run directory whose metrics.jsonl was removed still holds its checkpoints' model."""
    from mscale.runs.history import has_trained

    run = RunDir(str(tmp_path / "run"))
    run.create()
    write_plan(run, _plan(), plan_change_of(run, _plan()))
    (tmp_path / "run" / "ckpt" / "step-000010").mkdir()
    assert has_trained(run)
    with pytest.raises(MscaleError, match="another model or training recipe"):
        plan_change_of(run, _plan(model={"hidden": 128}))


def test_a_preflight_storage_probe_left_in_ckpt_is_no_training(tmp_path):
    """`mscale preflight` killed mid storage check leaves ``ckpt/.preflight-*``: the run still
    has not trained, so a fixed plan replaces the one no step trained with."""
    from mscale.runs.history import has_trained

    run = RunDir(str(tmp_path / "run"))
    run.create()
    write_plan(run, _plan(), plan_change_of(run, _plan()))
    (tmp_path / "run" / "ckpt" / ".preflight-node1-0").mkdir(parents=True)
    assert not has_trained(run)
    assert plan_change_of(run, _plan(model={"hidden": 128})).untrained
