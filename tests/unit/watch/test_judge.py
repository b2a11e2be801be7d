"""The judge: one finding per problem, closed when it clears, the same live as at once; restarts,
hangs, bad input and the summary."""

import json

import numpy as np
import pytest

from mscale.errors import MscaleError
from mscale.watch.config import WatchConfig
from mscale.watch.judge import Watcher
from mscale.watch.layout import JobLayout
from mscale.watch.sim import Injection, generate
from mscale.watch.window import Window

KW = dict(world=32, tp=2, pp=2, ranks_per_node=8)


def rows(window: Window, lo: int, hi: int) -> Window:
    return Window(window.steps[lo:hi], window.ranks[lo:hi], window.scalars[lo:hi],
                  window.extra[lo:hi])


def test_one_finding_per_problem_while_it_lasts():
    t = generate(**KW, steps=290, seed=1, inject=[Injection("slow_device", 30, 7)])
    w = Watcher(t.layout)
    found = w.feed(t.window())
    assert [(f.cause, f.ranks) for f in found] == [("slow_device", [7])]
    (f,) = w.open_findings()
    assert f is found[0] and f.last_step == 290 and f.evidence["detected_at"] <= 35
    json.dumps([vars(f) for f in found])  # plain types only: events and --json take them as is


def test_closed_when_it_clears_and_new_when_it_returns():
    t = generate(**KW, steps=200, seed=2, inject=[Injection("slow_device", 30, 7, until=80),
                                                  Injection("slow_device", 140, 7)])
    w = Watcher(t.layout, WatchConfig(clear_steps=8))
    found = w.feed(rows(t.window(), 0, 120))
    assert len(found) == 1 and w.open_findings() == []  # cleared within 8 judged steps
    assert w.cleared == found  # handed to the actor, which records it (test_actions.py)
    again = w.feed(rows(t.window(), 120, 200))
    assert [(f.cause, f.ranks) for f in again] == [("slow_device", [7])] and w.cleared == []
    assert again[0].evidence["detected_at"] >= 140 and w.summary()["emitted"] == {"straggler": 2}


def test_live_in_pieces_finds_what_once_finds():
    t = generate(**KW, steps=250, seed=3, inject=[
        Injection("slow_node", 60, 2), Injection("grad_spike", 100),
        Injection("divergence", 180)])
    once = Watcher(t.layout).feed(t.window())
    live, w, i = [], Watcher(t.layout), 0
    for size in np.random.default_rng(0).integers(1, 9, 200):
        live += w.feed(rows(t.window(), i, i + int(size)))
        i += int(size)
    summary = [(f.kind, f.cause, f.ranks, f.evidence["detected_at"]) for f in once]
    assert summary == [(f.kind, f.cause, f.ranks, f.evidence["detected_at"]) for f in live]
    assert {k for k, *_ in summary} == {"straggler", "grad_spike", "divergence"}


def test_a_restart_warms_up_again():
    t = generate(**KW, steps=120, seed=4)
    resumed = generate(**KW, steps=120, seed=5, warmup=(4.0, 2.0, 1.5))
    w = Watcher(t.layout)
    assert w.feed(t.window()) == []
    # the job resumes from its step-100 checkpoint: steps go back, the first ones are slow
    back = resumed.window()
    back.steps = back.steps + 99
    assert w.feed(back) == []
    assert w.summary()["masked_rows"]["warmup"] == 10


def test_records_of_another_world_are_bad_input():
    t = generate(world=8, tp=2, steps=3)
    with pytest.raises(MscaleError, match="16") as e:
        Watcher(JobLayout.from_flags(2, 1, 8, 8)).feed(t.window())
    assert e.value.field == "--tp/--pp/--dp"


def test_hang_after_the_limit_once_and_cleared_by_new_records():
    t = generate(**KW, steps=40, seed=6)
    w = Watcher(t.layout)
    assert w.check_hang(1000.0, None) == []  # nothing written yet: nothing to judge
    assert w.hang_limit() == WatchConfig().hang_startup_s
    assert Watcher(t.layout, WatchConfig(expected_step_s=10)).hang_limit() == 200
    w.feed(t.window())
    step = w.summary()["baseline_step_s"]
    assert w.hang_limit() == max(60.0, 20 * step)
    last = float(t.scalars["time"][-1])
    assert w.check_hang(last + 59, last) == []
    (h,) = w.check_hang(last + 61, last)
    assert h.kind == "hang" and h.severity == "critical" and h.last_step == 40
    assert w.check_hang(last + 90, last) == []  # still the same hang: not emitted again
    assert w.check_hang(last + 91, last + 90) == [] and w.open_findings() == []
    assert len(w.check_hang(last + 200, last + 90)) == 1  # a new hang
    assert Watcher(t.layout, WatchConfig(hang_s=5)).check_hang(10.0, 4.0)[0].kind == "hang"


def test_a_relaunch_loading_is_no_hang_until_the_startup_allowance_from_its_start():
    # Attempt 1's last record 1000 s ago, a relaunch started 5 s ago and still loading: the
    # silence was counted from the old record against the old step time, a critical "stuck".
    t = generate(**KW, steps=40, seed=6)
    w = Watcher(t.layout)
    w.feed(t.window())
    last = float(t.scalars["time"][-1])
    start = last + 995
    assert w.check_hang(last + 1000, last, attempt_start=start) == []
    startup = WatchConfig().hang_startup_s
    assert w.check_hang(start + startup - 1, last, attempt_start=start) == []
    (h,) = w.check_hang(start + startup + 1, last, attempt_start=start)
    assert h.kind == "hang" and "since the newest attempt started" in h.message
    # a start before the last record is the running attempt's own: the usual limit
    w2 = Watcher(t.layout)
    w2.feed(t.window())
    assert len(w2.check_hang(last + 61, last, attempt_start=last - 5)) == 1
    # an explicit --hang-s is the operator's limit, startup or not
    w3 = Watcher(t.layout, WatchConfig(hang_s=5))
    assert w3.check_hang(start + 6, last, attempt_start=start)[0].kind == "hang"


def test_summary_and_config_checks():
    t = generate(**KW, steps=80, seed=7, inject=[Injection("nan", 70)])
    w = Watcher(t.layout)
    w.feed(t.window())
    s = w.summary()
    assert s["worst"] == s["worst_open"] == "critical" and s["emitted"] == {"nan": 1}
    assert s["last_step"] == 80 and s["baseline_step_s"] > 0 and s["open"] == 1
    assert len(s["slowest_ranks"]) == 5 and s["slowest_nodes"][0]["node"].startswith("node")
    with pytest.raises(MscaleError, match="persist_steps"):
        WatchConfig(persist_steps=0)
    with pytest.raises(MscaleError, match="z_threshold"):
        WatchConfig(z_threshold=-1)
