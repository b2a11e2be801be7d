"""watch/target.py: the layout of each attempt of a re-planned run, with and without plans/."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

from mscale.topology.placement import load_checked_plan
from mscale.watch.layout import JobLayout
from mscale.watch.target import layout_source, resolve_target

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

    from mscale.config.base import load_model
    from mscale.config.plan import Plan
    from mscale.runs.history import record_plan
    from mscale.runs.rundir import RunDir
    from mscale.watch.sim import Injection, simulate
    from tests.unit.watch.replanned import _records, _start

    rd = RunDir(str(tmp_path / "run"))
    rd.create()
    shutil.copy(PLANS / "cpu-tiny.yaml", rd.plan)
    record_plan(rd, load_model(Plan, rd.plan))
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
