"""The trace generator: synchronous semantics, schema, noise, pauses and each injection."""

import numpy as np
import pytest

from mscale.config.records import MetricsRecord
from mscale.parallel.pipeline.schedule import simulate as simulate_schedule
from mscale.errors import MscaleError
from mscale.watch.sim import CAUSES, Injection, generate, simulate
from mscale.watch.stream import records_to_window


def test_records_follow_schema_1_and_read_back_as_the_trace():
    trace = generate(16, tp=2, pp=2, ranks_per_node=4, steps=12, seed=1)
    recs = trace.records()
    for rec in recs:
        MetricsRecord.model_validate(rec)
        assert rec["schema_version"] == 1 and len(rec["compute_time"]) == 16
    window = records_to_window(recs)
    assert np.array_equal(window.steps, np.arange(1, 13))
    assert np.allclose(window.ranks, trace.window().ranks)
    assert recs == simulate(16, tp=2, pp=2, ranks_per_node=4, steps=12, seed=1)


def test_every_rank_accounts_for_the_synchronous_step():
    t = generate(32, tp=2, pp=4, ranks_per_node=8, steps=50, seed=2)
    parts = t.compute + t.data + t.comm + t.bubble
    assert np.allclose(parts, t.step_time, atol=1e-3)
    # one step time for all ranks; bubble only with a pipeline
    assert np.ptp(t.step_time, axis=1).max() < 2e-3
    assert (t.bubble >= 0).all() and (t.comm >= 0).all()
    assert not generate(8, tp=2, pp=1, steps=5).bubble.any()


def test_step_is_the_slowest_replica_through_its_pipeline():
    t = generate(8, tp=1, pp=2, dp=4, ranks_per_node=8, steps=40, seed=3, micro_batches=4,
                 noise=0.0, hiccup_rate=0.0, gc_every=0, ckpt_every=0, warmup=(),
                 micro_noise=0.0, inject=[Injection("stage_imbalance", 1, 1, magnitude=1.0)])
    # stage 0 busy ~1.03, stage 1 ~2.03; each replica runs 1F1B's actions (a backward twice a
    # forward), checked against the schedule's own simulator, then the reduction
    own = (t.compute + t.data).reshape(40, 2, 4)
    replica = np.empty((40, 4))
    for i, d in np.ndindex(40, 4):
        per_action = own[i, :, d] / (3 * 4)
        timeline = simulate_schedule(2, 1, 4, per_action, 2 * per_action)
        replica[i, d] = max(ranks[-1][2] for ranks in timeline)
    assert np.allclose(t.step_time[:, 0] - t.comm[:, 4:].min(axis=1), replica.max(axis=1),
                       atol=1e-3)
    assert t.bubble[:, :4].mean() > t.bubble[:, 4:].mean()  # the light stage idles


def test_micro_batches_jitter_but_each_stage_keeps_its_busy_time():
    calm = generate(16, tp=2, pp=4, ranks_per_node=8, steps=30, seed=5, micro_noise=0.0)
    jit = generate(16, tp=2, pp=4, ranks_per_node=8, steps=30, seed=5, micro_noise=0.2)
    assert np.array_equal(calm.compute, jit.compute)  # the records' busy times are the truth
    slower = jit.step_time[:, 0] - calm.step_time[:, 0]
    assert (slower > -1e-3).mean() > 0.8 and slower.mean() > 0  # jitter only adds waiting


def test_noise_pauses_and_their_flags():
    t = generate(16, tp=2, pp=1, steps=200, seed=4, gc_every=50, ckpt_every=100)
    flagged = {i + 1: e for i, e in enumerate(t.extra) if e}
    assert flagged == {50: {"gc": True}, 100: {"gc": True, "checkpoint": True},
                       150: {"gc": True}, 200: {"gc": True, "checkpoint": True}}
    busy = (t.compute + t.data).mean(axis=1)
    assert busy[49] > 1.15 * np.median(busy) and busy[0] > 2 * np.median(busy)  # GC, warm-up
    spread = np.std(t.compute[10:40] / np.median(t.compute[10:40]), axis=1)
    assert 0.015 < spread.mean() < 0.06  # lognormal jitter of a few percent
    bare = generate(16, tp=2, pp=1, steps=60, seed=4, flag_pauses=False)
    assert not any(bare.extra) and bare.compute[49].mean() > 1.15 * np.median(bare.compute)


def test_same_seed_same_trace_other_seed_other_trace():
    a, b = generate(8, steps=20, seed=5), generate(8, steps=20, seed=5)
    assert np.array_equal(a.compute, b.compute)
    assert not np.array_equal(a.compute, generate(8, steps=20, seed=6).compute)


@pytest.mark.parametrize("cause,target,where", [
    ("slow_device", 5, lambda L: L.ranks == 5),
    ("slow_node", 1, lambda L: L.node == 1),
    ("stage_imbalance", 1, lambda L: L.pp_rank == 1),
])
def test_compute_injections_hit_their_target_from_their_step(cause, target, where):
    base = generate(16, tp=2, pp=2, ranks_per_node=4, steps=60, seed=7)
    t = generate(16, tp=2, pp=2, ranks_per_node=4, steps=60, seed=7,
                 inject=[Injection(cause, 30, target)])
    hit = where(t.layout)
    ratio = t.compute / base.compute
    assert np.allclose(ratio[:29], 1) and np.allclose(ratio[29:, ~hit], 1)
    assert (ratio[29:, hit] > 1.2).all()
    assert (t.step_time[35:, 0] > base.step_time[35:, 0]).all()


def test_data_link_and_job_wide_injections():
    kw = dict(tp=2, pp=1, ranks_per_node=4, steps=40, seed=8)
    base = generate(8, **kw)
    data = generate(8, **kw, inject=[Injection("slow_data", 10, 2)])
    assert (data.data[9:, 2] - base.data[9:, 2] > 0.25).all()
    assert np.allclose(data.data[:, [0, 1, 3, 4, 5, 6, 7]], base.data[:, [0, 1, 3, 4, 5, 6, 7]])
    link = generate(8, **kw, inject=[Injection("slow_link", 10, 6)])
    # rank 6: TP group {6, 7}, DP group {0, 2, 4, 6}; each group's transfer (its smallest
    # member time) grows by half the magnitude, the culprit's own time included
    for kind, members, others in (("comm_tp", [6, 7], [0, 1, 2, 3, 4, 5]),
                                  ("comm_dp", [0, 2, 4, 6], [1, 3, 5, 7])):
        got, was = getattr(link, kind), getattr(base, kind)
        assert (got[9:, members].min(axis=1) - was[9:, members].min(axis=1) > 0.09).all()
        assert np.allclose(got[:9], was[:9])
        assert np.allclose(got[9:, others].min(axis=1), was[9:, others].min(axis=1), atol=0.02)
    assert (link.comm[9:, 6] > base.comm[9:, 6] + 0.09).all()
    assert np.allclose(link.compute, base.compute)
    wide = generate(8, **kw, inject=[Injection("job_wide", 10)])
    assert ((wide.comm - base.comm)[9:] > 0.45).all()


def test_data_imbalance_moves_the_slow_replica_every_step():
    t = generate(16, tp=1, pp=1, ranks_per_node=8, steps=80, seed=9,
                 inject=[Injection("data_imbalance", 1)])
    slow = (t.compute[5:] / np.median(t.compute[5:], axis=1, keepdims=True)).argmax(axis=1)
    assert len(set(slow.tolist())) >= 10


def test_training_injections():
    kw = dict(world=4, steps=120, seed=10)
    base = generate(**kw)
    spike = generate(**kw, inject=[Injection("grad_spike", 60)])
    g = spike.scalars["grad_norm"] / base.scalars["grad_norm"]
    assert g[59] == pytest.approx(20) and np.allclose(np.delete(g, 59), 1)
    nan = generate(**kw, inject=[Injection("nan", 70)]).scalars
    assert np.isnan(nan["loss"][69:]).all() and np.isfinite(nan["loss"][:69]).all()
    div = generate(**kw, inject=[Injection("divergence", 50)]).scalars["loss"]
    assert div[-1] > 5 * base.scalars["loss"][-1] and np.allclose(div[:49],
                                                                    base.scalars["loss"][:49])


def test_bad_arguments_are_refused():
    with pytest.raises(MscaleError, match="world"):
        generate(10, tp=4)
    with pytest.raises(MscaleError, match="unknown cause"):
        generate(8, inject=[{"cause": "gremlins", "step": 3}])
    assert "slow_link" in CAUSES


def test_untraced_host_work_makes_peers_wait_but_no_group_slower():
    """Rank 0 writing logs: its TP peer and the other replicas wait for it, its own record
    accounts for less than the step, and every group's smallest member time stays a transfer."""
    kw = dict(tp=2, pp=1, ranks_per_node=4, steps=40, seed=8)
    base = generate(8, **kw)
    busy = generate(8, **kw, inject=[Injection("host_work", 10, 0)])
    assert (busy.comm_tp[9:, 1] - base.comm_tp[9:, 1] > 0.15).all()  # its TP peer waits
    for kind, groups in (("comm_tp", [[0, 1], [2, 3], [4, 5], [6, 7]]),
                         ("comm_dp", [[0, 2, 4, 6], [1, 3, 5, 7]])):
        for g in groups:
            assert np.allclose(getattr(busy, kind)[:, g].min(axis=1),
                               getattr(base, kind)[:, g].min(axis=1), atol=0.02)
    parts = busy.compute + busy.data + busy.comm + busy.bubble
    assert (busy.step_time[9:, 0] - parts[9:, 0] > 0.15).all()  # time its timers did not see
