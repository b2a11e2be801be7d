"""watch/target.py: what a path names (a run directory, a metrics file, one not there yet; an
event log refused), the layout from the plan, the flags or neither, and the layout of each attempt
of a re-planned run, with and without plans/."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from mscale.errors import MscaleError
from mscale.runs.rundir import RunDir
from mscale.topology.placement import load_checked_plan
from mscale.watch.layout import JobLayout
from mscale.watch.target import layout_source, require_run, resolve_target

from tests.conftest import PLANS
from tests.unit.watch.replanned import SLOW_NODE, SLOW_RANK, replanned_run


def test_a_replanned_run_copied_without_plans_is_laid_out_by_its_start_events(cli, tmp_path):
    """The 8-rank attempt before the re-plan took its layout from RUN/plans/ alone: copied
    without it, watch stopped with 'the records have 8 ranks, the layout 4' and a fix pointing at
    the plan. train's start event records the layout and the nodes in rank order."""
    rd = replanned_run(str(tmp_path / "run"))
    shutil.rmtree(rd.path("plans"))
    layout = layout_source(resolve_target(rd.root))(8)
    planned = JobLayout.from_plan(load_checked_plan(str(PLANS / "cpu-tiny.yaml")))
    # what the plan of that attempt gives, but the micro-batches (the what-if estimates them)
    assert layout == replace(planned, micro_batches=None)
    assert layout.node_names == ("node1", "node2", "node3", "node4") and layout.named
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 2, err
    [slow] = [f for f in doc["findings"] if f["kind"] == "straggler"]
    assert (slow["cause"], slow["ranks"], slow["nodes"]) == ("slow_device", [SLOW_RANK],
                                                             [SLOW_NODE])


def test_without_plans_or_a_recorded_layout_it_names_the_missing_folder(cli, tmp_path):
    rd = replanned_run(str(tmp_path / "run"))
    shutil.rmtree(rd.path("plans"))
    events = [json.loads(x) for x in open(rd.events)]
    for e in events:  # start events of an older train, which did not record the layout
        e["evidence"].pop("layout", None)
    with open(rd.events, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = cli("watch", rd.root, "--once", "--no-act")
    assert code == 3 and "Traceback" not in err, err
    assert err.startswith(f"error: {rd.path('plans')}: the records have 8 ranks and plan.yaml "
                          "4, and no layout of 8 ranks is recorded"), err
    assert "fix: a re-planned run copied without its plans/ folder: copy it along" in err
    # the fix's other way works: the old attempt judged on --tp/--pp, its nodes unnamed
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--tp", "2", "--pp", "2")
    assert code == 2 and "straggler/slow_device rank 5" in out, err


def test_nodes_are_named_as_the_start_event_records_them(cli, tmp_path):
    """Under srun, train records SLURM's names for the step's nodes (train/session.py
    `launch_record`); a plan of node[1-4] run on cn[01-04] had watch name, and quarantine,
    node3, a name SLURM does not know, for a slow rank on cn03."""
    rd = replanned_run(str(tmp_path / "run"), nodes=("cn01", "cn02", "cn03", "cn04"))
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--json")
    assert code == 2, err
    [slow] = [f for f in json.loads(out)["findings"] if f["kind"] == "straggler"]
    assert (slow["ranks"], slow["nodes"]) == ([SLOW_RANK], ["cn03"])
    # a hostlist given to watch is the operator's word: it names the nodes, not the records
    start = next(json.loads(x) for x in open(rd.events) if '"start"' in x)
    target = resolve_target(rd.root)
    assert layout_source(target)(8, start).node_names == ("cn01", "cn02", "cn03", "cn04")
    assert layout_source(target, hostlist="h[1-4]")(8, start).node_names == ("h1", "h2", "h3",
                                                                            "h4")


def test_a_relaunch_that_goes_on_at_the_next_step_is_named_by_its_own_start(cli, tmp_path):
    """Attempt 1 on cn01-cn04 stopped at step 40 (a preemption's checkpoint), attempt 2 resumed
    at 41 on cn01, cn02, cn05, cn04: no step went back and the ranks were as many, so watch
    judged it on attempt 1's layout and named its slow rank 5 cn03, a node the job no longer
    ran on (and would have quarantined it, not cn05)."""
    import time

    from mscale.runs.rundir import RunDir
    from mscale.watch.sim import Injection, simulate
    from tests.unit.watch.replanned import _records, _start

    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", rd.plan)
    t0 = time.time() - 3600
    _start(rd, 1, t0, 2, ["cn01", "cn02", "cn03", "cn04"])
    _records(rd, simulate(8, tp=2, pp=2, ranks_per_node=2, steps=40, seed=1), t0 + 10)
    _start(rd, 2, t0 + 600, 2, ["cn01", "cn02", "cn05", "cn04"])
    slow = simulate(8, tp=2, pp=2, ranks_per_node=2, steps=100, seed=2,
                    inject=[Injection("slow_device", 50, SLOW_RANK, magnitude=1.5)])
    _records(rd, [r for r in slow if r["step"] > 40], t0 + 610)
    code, out, err = cli("watch", rd.root, "--once", "--no-act", "--json")
    assert code == 2, err
    [found] = [f for f in json.loads(out)["findings"] if f["kind"] == "straggler"]
    assert (found["ranks"], found["nodes"]) == ([SLOW_RANK], ["cn05"])


def test_resolve_target(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    assert resolve_target(rd.root).run == rd and resolve_target(rd.root).plan_now() is None
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert resolve_target(rd.metrics).run is None  # no plan beside it: a file alone
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    t = resolve_target(rd.metrics)
    assert t.run == rd and t.plan_now() == rd.plan
    other = tmp_path / "trace.jsonl"
    other.write_text("")
    assert resolve_target(str(other)).run is None
    not_a_target = tmp_path / "notes.txt"
    not_a_target.write_text("")
    with pytest.raises(MscaleError) as e:
        resolve_target(str(not_a_target))
    assert e.value.file == str(not_a_target) and "not a run directory" in str(e.value)


def test_a_runs_event_log_is_refused_naming_the_run(tmp_path):
    # `mscale watch RUN/events.jsonl`: read as metrics it failed on "a record has no integer
    # step" and pointed at the metrics schema; the error must say what the file is instead.
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "run" / "events.jsonl").write_text('{"kind": "start"}\n')
    with pytest.raises(MscaleError) as e:
        resolve_target(rd.events)
    assert e.value.file == rd.events and "event log" in e.value.message
    assert rd.root in e.value.fix and "metrics.jsonl" in e.value.fix


def test_a_path_that_does_not_exist_yet_is_resolved_by_its_name(tmp_path):
    """A live watch started before the job was scheduled: the run directory (or metrics file)
    it names does not exist yet. It resolves, so a live watch can wait for it."""
    later = tmp_path / "runs" / "live"
    t = resolve_target(str(later))
    assert t.run == RunDir(str(later)) and t.metrics == f"{later}/metrics.jsonl"
    assert not t.exists() and not t.is_run()
    f = resolve_target(str(tmp_path / "later.jsonl"))
    assert f.run is None and not f.exists() and not f.is_run()
    assert f.plan == f"{tmp_path}/plan.yaml"  # read once a job writes it (plan_now)


@pytest.mark.parametrize("name,what", [("missing", "no such run directory or metrics file"),
                                       ("missing.jsonl", "no such metrics file")])
def test_once_refuses_a_path_that_does_not_exist(tmp_path, name, what):
    """--once judges what is there: nothing, at a path that does not exist, is an error naming
    the path and the fix, not a wait."""
    bad = tmp_path / name
    with pytest.raises(MscaleError) as e:
        require_run(resolve_target(str(bad)))
    assert e.value.file == str(bad) and e.value.message == what
    assert "check the path" in e.value.fix and "without --once" in e.value.fix
    assert not bad.exists()


def test_layout_from_plan_flags_or_flat(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    target = resolve_target(rd.root)
    plan = layout_source(target)(8)
    assert (plan.tp, plan.pp, plan.dp, plan.world) == (2, 2, 2, 8)
    flags = layout_source(target, tp=2, hostlist="gpu[1-4]")(8)
    assert (flags.tp, flags.pp, flags.dp, flags.ranks_per_node) == (2, 2, 2, 2)
    assert flags.node_name(7) == "gpu4" and flags.vpp == plan.vpp
    flat = layout_source(resolve_target(str(tmp_path)))(6)
    assert (flat.dp, flat.world) == (6, 6)
    alone = layout_source(resolve_target(str(tmp_path)), tp=2)(8)  # no plan: the flags alone
    assert (alone.tp, alone.pp, alone.dp, alone.named) == (2, 1, 4, False)


def test_a_flag_over_a_plan_replaces_its_field_only(tmp_path):
    """`--tp 2` over a tp2·pp2·dp2 plan put every rank on one placeholder node with pp 1, and
    a slow link was blamed on "node0"; the rest of the plan's layout and its nodes stay."""
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    target = resolve_target(rd.root)
    plan = layout_source(target)(8)
    same = layout_source(target, tp=2)(8)
    assert same == plan and same.named
    deeper = layout_source(target, pp=1)(8)
    assert (deeper.tp, deeper.pp, deeper.dp, deeper.stage_layers) == (2, 1, 4, None)
    assert deeper.node_names == plan.node_names and deeper.named
    refilled = layout_source(target, ranks_per_node=4)(8)  # ranks fill nodes otherwise
    assert refilled.ranks_per_node == 4 and not refilled.named
    renamed = layout_source(target, hostlist="gpu[1-4]")(8)  # the plan's 2 a node, renamed
    assert renamed.ranks_per_node == 2 and renamed.node_name(3) == "gpu2" and renamed.named
    for extra in ({}, {"ranks_per_node": 2}):  # which 4 of the 8 ran is not known
        with pytest.raises(MscaleError, match="the hostlist names 8 nodes, the layout needs 4"):
            layout_source(target, hostlist="gpu[1-8]", **extra)(8)
    wider = layout_source(target, dp=4)(16)
    assert wider.micro_batches == plan.micro_batches // 2 and wider.vpp == plan.vpp
    smaller = layout_source(target, tp=2, pp=2)(4)  # records of another job than the plan's
    assert smaller.dp == 1 and not smaller.named  # node1 may not be where they ran


def test_flags_set_a_damaged_plan_aside_and_say_so(tmp_path):
    """Flags are the way to watch a run whose plan.yaml does not load; without them it is an
    error, as before."""
    from mscale.errors import MscaleError

    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    (tmp_path / "run" / "plan.yaml").write_text("layout: [unclosed\n")
    with pytest.raises(MscaleError):
        layout_source(resolve_target(rd.root))
    said = []
    layout = layout_source(resolve_target(rd.root), tp=2, pp=2, hostlist="gpu[1-4]",
                           note=said.append)(8)
    assert (layout.tp, layout.pp, layout.dp, layout.node_name(7)) == (2, 2, 2, "gpu4")
    assert len(said) == 1 and "set aside" in said[0] and "the flags alone" in said[0]


def test_a_plan_written_after_watch_started_lays_out_the_records(tmp_path):
    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    layout_for = layout_source(resolve_target(rd.root))  # train has not written plan.yaml yet
    (tmp_path / "run" / "plan.yaml").write_text((PLANS / "cpu-tiny.yaml").read_text())
    layout = layout_for(8)
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2) and layout.node_name(7) == "node4"


def test_once_refuses_a_directory_no_run_has_written_to(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MscaleError) as e:
        require_run(resolve_target(str(empty)))
    assert e.value.file == str(empty)
    assert "plan.yaml, lock.json, metrics.jsonl or events.jsonl" in str(e.value)
    assert "without --once" in e.value.fix
    for name in ("lock.json", "plan.yaml", "metrics.jsonl"):  # any one of them makes a run
        d = tmp_path / name.split(".")[0]
        d.mkdir()
        (d / name).write_text("")
        require_run(resolve_target(str(d)))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    require_run(resolve_target(str(trace)))


def test_flags_that_do_not_divide_the_records_ranks_say_so(tmp_path):
    target = resolve_target(str(tmp_path / "trace.jsonl"))
    with pytest.raises(MscaleError, match=r"--tp 3 x --pp 1 = 3 does not divide the records' "
                                          r"1024 ranks") as e:
        layout_source(target, tp=3)(1024)
    assert e.value.field == "--tp" and "tp·pp·dp = 1024" in e.value.fix
