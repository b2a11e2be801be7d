"""watch/actions.py: one event per finding, checkpoint before quarantine, halt on NaN, rollback
advice on divergence, nothing written with --no-act."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mscale.errors import MscaleError
from mscale.runs.atomic import read_jsonl
from mscale.runs.rundir import RunDir
from mscale.watch.actions import ActionConfig, Actor
from mscale.watch.findings import Finding


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def straggler(cause="slow_device", ranks=(3,), nodes=("node2",), first=10, last=15):
    return Finding(kind="straggler", severity="warning", message="rank 3 is slow", cause=cause,
                   ranks=list(ranks), nodes=list(nodes), first_step=first, last_step=last,
                   slowdown_pct=np.float64(25.0), evidence={"compute_z": np.float32(9.5),
                                                            "peers": np.arange(3)})


@pytest.fixture
def run(tmp_path) -> RunDir:
    r = RunDir(str(tmp_path / "run"))
    r.create()
    return r


def actor(run, clock, **kw) -> Actor:
    a = Actor(run, ActionConfig(**kw), clock=clock)
    a.seed(read_jsonl(run.events))
    return a


def watch_events(run):
    return [e for e in read_jsonl(run.events) if e["source"] == "watch"]


def test_each_finding_is_one_event_with_its_evidence_and_not_recorded_twice(run):
    clock = Clock()
    a = actor(run, clock)
    f = straggler(cause="stage_imbalance", ranks=(2, 3), nodes=("node2",))
    a.handle([f], job_alive=True)
    [ev] = watch_events(run)
    assert ev["kind"] == "straggler" and ev["severity"] == "warning"
    assert ev["ranks"] == [2, 3] and ev["nodes"] == ["node2"] and ev["step"] == 15
    assert ev["evidence"]["cause"] == "stage_imbalance"
    assert ev["evidence"]["slowdown_pct"] == 25.0 and ev["evidence"]["peers"] == [0, 1, 2]
    assert ev["evidence"]["first_step"] == 10
    # a second watch over the same steps (e.g. --once after a live watch) records nothing new
    again = actor(run, clock)
    again.handle([straggler(cause="stage_imbalance", ranks=(2, 3), nodes=("node2",), last=40)],
                 job_alive=True)
    assert len(watch_events(run)) == 1
    # the same problem later, after it had cleared, is a new episode
    again.handle([straggler(cause="stage_imbalance", ranks=(2, 3), nodes=("node2",), first=90,
                            last=95)], job_alive=True)
    assert len(watch_events(run)) == 2


def test_a_recorded_finding_that_cleared_is_recorded_as_cleared_once(run):
    """An ``info`` event (no reader takes it for the finding), its key and episode kept, so
    recover can tell a link that recovered from one still slow."""
    a = actor(run, Clock())
    link = dict(cause="slow_link", ranks=(), nodes=())  # placed on no node: nothing to act on
    a.clear([straggler(**link, first=10, last=30)])  # never recorded: nothing
    assert watch_events(run) == []
    a.handle([straggler(**link)], job_alive=True)
    a.clear([straggler(**link, first=10, last=30)])
    opened, cleared = watch_events(run)
    assert cleared["kind"] == "info" and cleared["severity"] == "info"
    assert cleared["message"] == "cleared after step 30: rank 3 is slow"
    evd = cleared["evidence"]
    assert evd["cleared"] is True and evd["finding"] == "straggler" and evd["last_step"] == 30
    assert evd["finding_key"] == opened["evidence"]["finding_key"]
    again = actor(run, Clock())  # a second watch over the same steps: recorded already
    again.clear([straggler(**link, first=10, last=30)])
    assert len(watch_events(run)) == 2


def test_imbalance_never_quarantines_or_requests(run):
    a = actor(run, Clock())
    for cause in ("stage_imbalance", "data_imbalance", "slow_data", "job_wide"):
        a.handle([straggler(cause=cause)], job_alive=True)
    assert not os.path.exists(run.quarantine)
    assert os.listdir(run.control) == []
    assert not a.pending


def test_hardware_straggler_checkpoint_first_then_quarantine(run):
    clock = Clock(1000.0)
    a = actor(run, clock)
    a.handle([straggler()], job_alive=True)
    request = json.loads(open(run.path("control", "checkpoint")).read())
    assert request["source"] == "watch" and request["nodes"] == ["node2"]
    assert not os.path.exists(run.quarantine) and a.pending
    # a checkpoint committed before the request does not count
    a.observe([{"source": "train", "kind": "checkpoint", "time": 999.0, "step": 12}])
    assert not os.path.exists(run.quarantine)
    clock.t = 1010.0
    a.observe([{"source": "train", "kind": "checkpoint", "time": 1008.0, "step": 16}])
    q = json.loads(open(run.quarantine).read())
    [entry] = q["entries"]
    assert entry["node"] == "node2" and entry["since"] == 1010.0
    assert entry["expires"] == 1010.0 + 24 * 3600
    assert entry["reason"].startswith("watch: ")
    ev = entry["evidence"]
    assert ev["checkpoint_confirmed"] and ev["checkpoint"].endswith("ckpt/step-000016")
    assert ev["cause"] == "slow_device" and ev["ranks"] == [3] and ev["compute_z"] == 9.5
    kinds = [(e["kind"], e["evidence"].get("action", "")) for e in watch_events(run)]
    assert kinds[0][0] == "straggler" and kinds[0][1].startswith("checkpoint requested")
    assert kinds[1] == ("info", "quarantine")
    assert [x["action"] for x in a.log if x["action"] != "event"] == ["control/checkpoint",
                                                                       "quarantine"]


def test_quarantine_goes_ahead_flagged_when_no_checkpoint_comes(run):
    clock = Clock(1000.0)
    a = actor(run, clock, ckpt_wait_s=60.0)
    a.handle([straggler()], job_alive=True)
    clock.t = 1059.0
    a.tick(job_alive=True)
    assert not os.path.exists(run.quarantine)
    clock.t = 1061.0
    a.tick(job_alive=True)
    [entry] = json.loads(open(run.quarantine).read())["entries"]
    assert entry["evidence"]["checkpoint_confirmed"] is False
    last = watch_events(run)[-1]
    assert last["severity"] == "warning" and "unconfirmed" in last["message"]


def test_job_not_running_quarantines_at_once_without_a_request(run):
    a = actor(run, Clock(), quarantine_s=None)
    a.handle([straggler(cause="slow_node", ranks=(2, 3))], job_alive=False)
    assert os.listdir(run.control) == []
    [entry] = json.loads(open(run.quarantine).read())["entries"]
    assert entry["node"] == "node2" and entry["expires"] is None
    # the finding's event comes first: it explains the quarantine that follows
    assert [(e["kind"], e["evidence"]["action"]) for e in watch_events(run)] == [
        ("straggler", "quarantined at once: the job is not running"), ("info", "quarantine")]


def test_placeholder_node_names_are_never_quarantined(run):
    """Flags without --hostlist name nodes node0, node1...: names a real cluster may have."""
    from mscale.watch.layout import JobLayout

    assert not JobLayout.from_flags(2, 1, 4, 4).named and not JobLayout.flat(8).named
    assert JobLayout.from_flags(2, 1, 4, 4, hostlist="gpu[1-2]").named
    a = actor(run, Clock())
    a.handle([straggler()], job_alive=False, nodes_named=False)
    [ev] = watch_events(run)
    assert ev["evidence"]["action"].startswith("none: the node names are placeholders")
    assert not os.path.exists(run.quarantine) and os.listdir(run.control) == []


def test_a_node_already_quarantined_is_not_added_again(run):
    clock = Clock()
    a = actor(run, clock)
    a.handle([straggler(cause="slow_node")], job_alive=False)
    a.handle([straggler(cause="slow_device", first=50, last=55)], job_alive=False)
    assert len(json.loads(open(run.quarantine).read())["entries"]) == 1


def test_unreadable_quarantine_fails_before_any_work(run):
    open(run.quarantine, "w").write("{not json")
    with pytest.raises(MscaleError) as e:
        actor(run, Clock())
    assert e.value.file == run.quarantine
    actor(run, Clock(), act=False)  # --no-act never reads nor writes it


def test_nan_requests_a_halt(run):
    a = actor(run, Clock())
    nan = Finding(kind="nan", severity="critical", message="loss is NaN", first_step=7,
                  last_step=7, evidence={"loss": float("nan")})
    a.handle([nan], job_alive=True)
    assert os.path.exists(run.path("control", "halt"))
    [ev] = watch_events(run)
    assert ev["kind"] == "nan" and ev["severity"] == "critical"


def test_divergence_names_the_newest_committed_checkpoint_before_it(run):
    for step, committed in ((10, True), (20, True), (24, False), (30, True)):
        os.makedirs(run.path("ckpt", f"step-{step:06d}"))
        if committed:
            open(run.path("ckpt", f"step-{step:06d}", "COMMITTED"), "w").write("{}")
    a = actor(run, Clock())
    div = Finding(kind="divergence", severity="critical", message="loss diverged",
                  first_step=25, last_step=29)
    a.handle([div], job_alive=True)
    [ev] = watch_events(run)
    assert ev["evidence"]["rollback_to"].endswith("ckpt/step-000020")
    assert ev["evidence"]["action"].startswith("roll back to")
    assert not os.path.exists(run.path("control", "halt"))


def test_throughput_kind_outside_the_event_schema_is_written_as_info(run):
    a = actor(run, Clock())
    a.handle([Finding(kind="throughput", severity="warning", message="12% below baseline",
                      cause="job_wide", first_step=40, last_step=45)], job_alive=True)
    [ev] = watch_events(run)
    assert ev["evidence"]["finding"] == "throughput"
    assert ev["kind"] in ("info", "throughput")


def test_no_act_writes_nothing(run):
    before = sorted(os.listdir(run.root))
    a = actor(run, Clock(), act=False)
    a.handle([straggler(), Finding(kind="nan", severity="critical", message="NaN")],
             job_alive=True)
    a.tick(job_alive=False)
    assert sorted(os.listdir(run.root)) == before and os.listdir(run.control) == []
    assert not a.pending


def test_a_metrics_file_alone_has_nothing_to_act_on():
    a = Actor(None, ActionConfig())
    a.seed([])
    a.handle([straggler()], job_alive=True)
    assert not a.acting and not a.pending
