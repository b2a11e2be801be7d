"""Data parallel + ZeRO on gloo against a single-process run of the same model and data.

Tolerances: the only differences from the reference are the summation order of the gradient
reduction (~1e-7 relative in fp32), which AdamW's m/sqrt(v) can amplify on tiny gradients; so
losses and norms must agree to 1e-5 relative and every parameter to 1e-4 relative (|Δ| /
(|ref| + 1e-3)) after 4 steps with lr 1e-2. DP ranks must hold bit-identical parameters.
"""

import time
from datetime import timedelta

import pytest
import torch

from tests.distributed.dp_model import (BUCKET_BYTES, SHAPES, Reference, config, dp_run, global_grads,
                                 make_params, make_table, max_rel_diff, reference_run)
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.dist
STEPS = 4
TIMEOUT = timedelta(seconds=60)


def _train_cases(rank, world, cases):
    """Each case: (zero, optimizer, hierarchical, overlap); world 4 = 2 nodes × 2 ranks. The
    hierarchical chain records the order in which it issued its collectives, and from where."""
    import threading

    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement

    per_node = 2 if world == 4 else world
    groups = build_groups(Placement(tp=1, pp=1, dp=world, gpus_per_node=per_node), rank, TIMEOUT,
                          hierarchical_dp=world == 4)
    out = {}
    for zero, optimizer, hier, overlap in cases:
        cfg = config(optimizer, overlap_grad_reduce=overlap)
        params = make_params(0)
        grads, pbuf = data_parallel(params, make_table(), groups, zero_stage=zero,
                           bucket_bytes=BUCKET_BYTES,
                           overlap=overlap, hierarchical=hier)
        if hier:
            grads.comm.issued = []
        outer = _time_calls(grads, "finish")
        opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg, groups)
        losses, norms, waits = dp_run(params, grads, opt, cfg, STEPS, groups.dp_rank, world)
        out[(zero, optimizer, hier, overlap)] = {
            "losses": losses, "norms": norms, "params": [p.detach() for p in params],
            "overlapped": grads.overlapped_buckets, "buckets": len(grads.layout.buckets),
            "waits": list(zip(waits, outer)), "main_thread": threading.get_ident(),
            "issued": getattr(grads.comm, "issued", None)}
        grads.close()
    return out


def _time_calls(obj, name: str) -> list[float]:
    """Wrap ``obj.name`` so that each call's wall time is appended to the returned list."""
    inner, times = getattr(obj, name), []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return times


def _check(results, world):
    refs = {opt: reference_run(config(opt), STEPS) for opt in ("adamw", "lamb")}
    for key, r0 in results[0].items():
        zero, optimizer, hier, overlap = key
        ref_losses, ref_norms, ref_params = refs[optimizer]
        mean_loss = [sum(r[key]["losses"][s] for r in results) / world for s in range(STEPS)]
        assert mean_loss == pytest.approx(ref_losses, rel=1e-5), key
        assert r0["norms"] == pytest.approx(ref_norms, rel=1e-5), key
        assert max_rel_diff(r0["params"], ref_params) < 1e-4, key
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r[key]["params"], r0["params"])), key
            assert r[key]["norms"] == r0["norms"], key
        assert r0["buckets"] >= 3
        assert (r0["overlapped"] > 0) == overlap, key
        # finish() reports the seconds it spent blocked: some, and no more than the call lasted
        assert all(0 < waited <= call for waited, call in r0["waits"]), (key, r0["waits"])


def _check_issue_order(results, key):
    """The hierarchical chain issued from one thread (the training thread, which runs backward on
    CPU) in one order, the same on every rank: bucket by bucket, each bucket's steps in chain
    order; the updated shards' all-gathers after the step, bucket by bucket."""
    logs = [[(group, op) for group, op, _ in r[key]["issued"]] for r in results]
    assert all(log == logs[0] for log in logs[1:]), key
    zero, buckets = key[0], results[0][key]["buckets"]
    chain = ([("intra", "reduce_scatter"), ("inter", "all_reduce"), ("intra", "all_gather")]
             if zero == 0 else [("intra", "reduce_scatter"), ("inter", "reduce_scatter")])
    gather = [] if zero == 0 else [("inter", "all_gather"), ("intra", "all_gather")]
    assert logs[0] == (chain * buckets + gather * buckets) * STEPS, key
    for r in results:
        assert {t for _, _, t in r[key]["issued"]} == {r[key]["main_thread"]}, key


def test_dp4_flat_and_hierarchical_all_zero_stages_match_single_process():
    cases = [(z, o, False, True) for z in (0, 1, 2) for o in ("adamw", "lamb")]
    cases += [(z, "adamw", True, True) for z in (0, 1, 2)] + [(1, "lamb", True, True)]
    cases += [(1, "adamw", False, False), (2, "adamw", True, False)]
    results = run_distributed(_train_cases, 4, cases)
    _check(results, 4)
    for z in (0, 1, 2):  # hierarchical gives what flat gives
        flat, hier = results[0][(z, "adamw", False, True)], results[0][(z, "adamw", True, True)]
        assert max_rel_diff(hier["params"], flat["params"]) < 1e-5
    for key in results[0]:
        if key[2]:
            _check_issue_order(results, key)


def test_dp2_all_zero_stages_match_single_process():
    cases = [(z, o, False, True) for z in (0, 1, 2) for o in ("adamw", "lamb")]
    _check(run_distributed(_train_cases, 2, cases), 2)


def _inject(params, table, grads_full, scale):
    """Backward of sum(p · g) puts g (this rank's TP slice, times ``scale``) into p.grad."""
    by_name = {s[0]: g for s, g in zip(SHAPES, grads_full)}
    loss = sum((p * by_name[spec.name][table.local_slice(spec)] * scale).sum()
               for p, spec in zip(params, table, strict=True))
    loss.backward()


def _tp_pp_norm_and_step(rank, world):
    """tp2 × dp2: global norm, LAMB/AdamW steps with clipping; pp2 × dp2: norm over stages."""
    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement

    g_full = global_grads()
    out = {"tp": {}, "pp": {}}
    groups = build_groups(Placement(tp=2, pp=1, dp=2, gpus_per_node=4), rank, TIMEOUT)
    scale = (0.5, 1.5)[groups.dp_rank]  # DP mean of the injected gradients is g_full
    for zero in (0, 1, 2):
        for optimizer in ("adamw", "lamb"):
            cfg = config(optimizer)
            params, table = make_params(0, groups.tp_rank, 2), make_table(groups.tp_rank, 2)
            grads, pbuf = data_parallel(params, table, groups, zero_stage=zero, bucket_bytes=BUCKET_BYTES)
            opt = DistributedOptimizer(params, table, grads, pbuf, cfg, groups)
            norms = []
            for _ in range(2):
                _inject(params, table, g_full, scale)
                grads.finish()
                norms.append(opt.grad_norm())
                opt.step(cfg.lr, clip_coef=opt.clip_coef(cfg.grad_clip))
            out["tp"][(zero, optimizer)] = (norms, [p.detach() for p in params], groups.tp_rank)
            grads.close()
    groups = build_groups(Placement(tp=1, pp=2, dp=2, gpus_per_node=4), rank, TIMEOUT)
    names = [s[0] for s in SHAPES][:3] if groups.pp_rank == 0 else [s[0] for s in SHAPES][3:]
    for zero in (0, 1, 2):
        params, table = make_params(0, names=names), make_table(names=names)
        grads, pbuf = data_parallel(params, table, groups, zero_stage=zero, bucket_bytes=BUCKET_BYTES)
        opt = DistributedOptimizer(params, table, grads, pbuf, config(), groups)
        _inject(params, table, g_full, (0.5, 1.5)[groups.dp_rank])
        grads.finish()
        out["pp"][zero] = opt.grad_norm()
        grads.close()
    return out


def test_global_norm_over_tp_pp_dp_and_tp_sharded_updates():
    results = run_distributed(_tp_pp_norm_and_step, 4)
    full_norm = float(torch.sqrt(sum((g * g).sum() for g in global_grads())))
    for r in results:
        for zero in (0, 1, 2):
            assert r["pp"][zero] == pytest.approx(full_norm, rel=1e-6)
    for key in results[0]["tp"]:
        cfg = config(key[1])
        params = make_params(0)
        ref, ref_norms = Reference(params, cfg), []
        for _ in range(2):
            for p, g in zip(params, global_grads()):
                p.grad = g.clone()
            ref_norms.append(ref.step())
        for r in results:
            norms, local, tp_rank = r["tp"][key]
            assert norms == pytest.approx(ref_norms, rel=1e-6), key
            want = [p.detach()[s.tp_slice(tp_rank, 2)] for p, s in zip(params, make_table())]
            assert max_rel_diff(local, want) < 1e-5, key


def _views_vs_copies(rank, world):
    """Per ZeRO stage: the run with gradient views + parameter buffer, and the copy path (no
    parameter declared viewable); plus what ZeRO-2 holds during and after accumulation."""
    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement
    from tests.distributed.dp_model import batch, loss_fn

    groups = build_groups(Placement(tp=1, pp=1, dp=world, gpus_per_node=world), rank, TIMEOUT)
    out = {"runs": {}}
    import mscale.parallel.data as data

    viewable = data._viewable
    for zero in (0, 1, 2):
        for views in (True, False):
            data._viewable = viewable if views else (lambda p, device: False)
            cfg = config()
            params = make_params(0)
            grads, pbuf = data_parallel(params, make_table(), groups, zero_stage=zero,
                                        bucket_bytes=BUCKET_BYTES)
            opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg, groups)
            losses, norms, _ = dp_run(params, grads, opt, cfg, STEPS, groups.dp_rank, world)
            out["runs"][(zero, views)] = (losses, norms, [p.detach().clone() for p in params])
            if views:
                out[("in_param_buffer", zero)] = all(_inside(p, pbuf.buffer) for p in params)
                out[("master_is_params", zero)] = opt.master is pbuf.buffer
            grads.close()
    data._viewable = viewable
    params = make_params(0)
    grads, pbuf = data_parallel(params, make_table(), groups, zero_stage=2, bucket_bytes=BUCKET_BYTES)
    out["z2_before"] = [p.grad is None for p in params]
    x, y = batch(0)
    with grads.no_sync():
        loss_fn(params, x[:4], y[:4]).backward()
    out["z2_during"] = [any(b is not None and _inside(p.grad, b) for b in grads._bufs)
                        for p in params]
    loss_fn(params, x[4:8], y[4:8]).backward()
    grads.finish()
    out["z2_after"] = ([p.grad is None for p in params], [b is None for b in grads._bufs])
    grads.close()
    return out


def _inside(t, flat) -> bool:
    lo, size = flat.data_ptr(), flat.numel() * flat.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + size


def test_dp2_gradient_views_and_param_buffer_match_copying_bit_for_bit():
    """Gradients accumulated in place in bucket views, parameters as views of one flat buffer
    (all-gathered into directly; the master under ZeRO 0) give exactly the copy path's numbers;
    ZeRO-2's bucket storage and the ``.grad`` views into it exist only between the first
    gradient of the step and `finish`."""
    for r in run_distributed(_views_vs_copies, 2):
        for zero in (0, 1, 2):
            (l1, n1, p1), (l2, n2, p2) = r["runs"][(zero, True)], r["runs"][(zero, False)]
            assert l1 == l2 and n1 == n2, zero
            assert all(torch.equal(a, b) for a, b in zip(p1, p2)), zero
            assert r[("in_param_buffer", zero)], zero
            assert r[("master_is_params", zero)] == (zero == 0), zero
        assert all(r["z2_before"]) and all(r["z2_during"])
        assert all(r["z2_after"][0]) and all(r["z2_after"][1])


class _Net(torch.nn.Module):
    """Linear layers, and a head weight read by the root's forward (no module of its own runs):
    the forward hooks must find it in the first forward."""

    def __init__(self):
        super().__init__()
        from mscale.parallel.spec import ParamSpec, ParamTable

        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        self.head = torch.nn.Linear(16, 8, bias=False)
        self.table = ParamTable(tuple(ParamSpec(name, tuple(p.shape), None, p.dim() > 1)
                                      for name, p in self.named_parameters()))

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.layers(x)), self.head.weight)


def _param_gather_cases(rank, world, cases):
    from mscale.config.training import TrainingConfig
    from mscale.distributed.groups import build_groups
    from mscale.parallel.data import data_parallel
    from mscale.parallel.zero import DistributedOptimizer
    from mscale.topology.placement import Placement

    groups = build_groups(Placement(tp=1, pp=1, dp=world, gpus_per_node=world), rank, TIMEOUT)
    out = {}
    for zero, optimizer, deferred in cases:
        model = _Net()
        params = list(model.parameters())
        grads, pbuf = data_parallel(params, model.table, groups, zero_stage=zero,
                           bucket_bytes=16 * 17 * 4,
                           overlap_param_gather=deferred)
        pbuf.attach_modules([model])
        cfg = TrainingConfig(global_batch=2, lr=1e-2, optimizer=optimizer, weight_decay=0.1)
        opt = DistributedOptimizer(params, model.table, grads, pbuf, cfg, groups)
        gen = torch.Generator().manual_seed(rank)
        losses, pending = [], []
        for _ in range(4):
            x = torch.randn(8, 16, generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            losses.append(float(loss.detach()))
            grads.finish()
            opt.step(cfg.lr, opt.clip_coef(1.0))
            pending.append(pbuf.in_flight)
        opt.wait_params()
        out[(zero, optimizer, deferred)] = {"losses": losses, "pending": pending,
                                            "params": [p.detach().clone() for p in params],
                                            "buckets": len(grads.layout.buckets)}
        grads.close()
    return out


def test_dp2_overlapped_param_gather_is_bit_identical_to_blocking():
    cases = [(z, o, d) for z in (0, 1, 2) for o in ("adamw", "lamb") for d in (True, False)]
    results = run_distributed(_param_gather_cases, 2, cases)
    for r in results:
        for zero, optimizer, _ in cases:
            on, off = r[(zero, optimizer, True)], r[(zero, optimizer, False)]
            assert on["losses"] == off["losses"], (zero, optimizer)
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
            assert off["pending"] == [0] * 4
            # ZeRO 0 gathers nothing; ZeRO 1/2 defer every bucket (the first forward, before
            # the first step, was the observing one)
            expect = [0] * 4 if zero == 0 else [on["buckets"]] * 4
            assert on["pending"] == expect, (zero, optimizer, on["pending"])
            assert on["buckets"] > 2
    for key in results[0]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][key]["params"],
                                                     results[1][key]["params"]))
