"""Gradient buffer layout and the distributed optimizer in one process (DP size 1)."""

import contextlib

import pytest
import torch

from mscale.parallel.buckets import BufferLayout
from mscale.parallel import data
from mscale.parallel.data import data_parallel
from mscale.parallel.optim import trust_ratio
from mscale.parallel.zero import DistributedOptimizer
from tests.distributed.dp_model import (BUCKET_BYTES, config, dp_run, make_params, make_table,
                                        max_rel_diff,
                                 reference_run)


def test_layout_reverse_order_whole_params_padding_and_shards():
    params = make_params(0)
    lay = BufferLayout(params, make_table(), dp_size=4, bucket_numel=100)
    assert [s.spec.name for s in lay.slots][0] == "head.weight"  # last registered comes first
    assert len(lay.buckets) >= 3
    for b in lay.buckets:
        assert b.padded % 4 == 0 and b.padded - b.numel < 4
    assert lay.total == sum(b.padded for b in lay.buckets)
    # the shards of all DP ranks cover every element of every parameter exactly once
    seen = {s.index: torch.zeros(s.numel) for s in lay.slots}
    for r in range(4):
        for pc in lay.pieces(r):
            seen[pc.param_index][pc.param_lo:pc.param_hi] += 1
    assert all(bool((v == 1).all()) for v in seen.values())
    whole = lay.pieces(None)
    assert sum(pc.numel for pc in whole) == sum(p.numel() for p in params)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_single_process_matches_reference(zero, optimizer):
    cfg = config(optimizer)
    ref_losses, ref_norms, ref_params = reference_run(cfg, steps=4)
    params = make_params(0)
    grads, pbuf = data_parallel(params, make_table(), None, zero_stage=zero, bucket_bytes=BUCKET_BYTES)
    opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
    losses, norms, _ = dp_run(params, grads, opt, cfg, steps=4, dp_rank=0, dp_size=1)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert max_rel_diff([p.detach() for p in params], ref_params) < 1e-4


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_fused_adamw_matches_torch_fused_adamw(zero):
    """The GPU default (torch's fused AdamW kernel over the shard's views, decay and no-decay
    pieces apart), run here on the CPU against ``torch.optim.AdamW(fused=True)``; and it is not
    the single-tensor path by another name (their rounding differs)."""
    cfg = config("adamw")
    ref_losses, ref_norms, ref_params = reference_run(cfg, steps=4, fused=True)
    runs = {}
    for fused in (True, False):
        params = make_params(0)
        grads, pbuf = data_parallel(params, make_table(), None, zero_stage=zero,
                                    bucket_bytes=BUCKET_BYTES)
        opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg, fused=fused)
        assert opt.fused is fused
        losses, _, _ = dp_run(params, grads, opt, cfg, steps=4, dp_rank=0, dp_size=1)
        runs[fused] = (losses, [p.detach().clone() for p in params])
    losses, params = runs[True]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(params, ref_params) < 1e-5
    assert any(not torch.equal(a, b) for a, b in zip(params, runs[False][1]))


def test_gradient_after_its_bucket_was_reduced_is_refused():
    params = make_params(0)
    grads, pbuf = data_parallel(params, make_table(), None, bucket_bytes=BUCKET_BYTES)
    from tests.distributed.dp_model import batch, loss_fn

    x, y = batch(0)
    loss_fn(params, x, y).backward()  # outside no_sync: reductions launched
    with pytest.raises(RuntimeError, match="no_sync"):
        loss_fn(params, x, y).backward()


def test_non_finite_gradient_skips_the_step_and_is_reported():
    cfg = config()
    params = make_params(0)
    before = [p.detach().clone() for p in params]
    grads, pbuf = data_parallel(params, make_table(), None, zero_stage=1, bucket_bytes=BUCKET_BYTES)
    opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
    from tests.distributed.dp_model import batch, loss_fn

    x, y = batch(0)
    (loss_fn(params, x, y) * float("nan")).backward()  # a blow-up: NaN in every gradient
    grads.finish()
    assert opt.grad_norm() != opt.grad_norm() or opt.grad_norm() == float("inf")
    assert opt.found_non_finite
    opt.step(cfg.lr)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and opt.step_count == 0


def test_state_dict_round_trip_and_pieces():
    cfg = config("lamb")
    params = make_params(0)
    grads, pbuf = data_parallel(params, make_table(), None, zero_stage=1, bucket_bytes=BUCKET_BYTES)
    opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
    dp_run(params, grads, opt, cfg, steps=2, dp_rank=0, dp_size=1)
    sd = opt.state_dict()
    assert sd["step"] == 2 and set(sd["state"]) == set(make_table().names)
    fresh = make_params(0)
    grads2, pbuf2 = data_parallel(fresh, make_table(), None, zero_stage=1, bucket_bytes=BUCKET_BYTES)
    opt2 = DistributedOptimizer(fresh, make_table(), grads2, pbuf2, cfg)
    opt2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh, params))
    dp_run(params, grads, opt, cfg, steps=1, dp_rank=0, dp_size=1)
    dp_run(fresh, grads2, opt2, cfg, steps=1, dp_rank=0, dp_size=1)
    assert all(torch.equal(a, b) for a, b in zip(fresh, params))
    pieces = opt.shard_pieces()
    assert all(pc.hi - pc.lo == torch.Size(pc.local_shape).numel() for pc in pieces)


def test_trust_ratio_is_one_for_zero_norms():
    r = trust_ratio(torch.tensor([4.0, 0.0, 4.0]), torch.tensor([1.0, 1.0, 0.0]))
    assert r.tolist() == [2.0, 1.0, 1.0]


def _in(t: torch.Tensor, flat: torch.Tensor) -> bool:
    """``t``'s storage lies inside ``flat``'s."""
    lo, size = flat.data_ptr(), flat.numel() * flat.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + size


def test_grads_accumulate_in_place_in_the_bucket_views():
    """AccumulateGrad adds into an existing ``.grad`` view in place (it must not replace it), so
    the buffer holds 0 + g1 + g2 bit for bit, with no hook copy; a ``.grad`` reset to None in
    between is added by the hook instead and the view is put back."""
    from tests.distributed.dp_model import batch, loss_fn

    params = make_params(0)
    grads, pbuf = data_parallel(params, make_table(), None, zero_stage=1, bucket_bytes=BUCKET_BYTES)
    views = [p.grad for p in params]
    assert all(v is not None and _in(v, grads.owned_grad) for v in views)
    x, y = batch(0)
    halves = [(x[:8], y[:8]), (x[8:], y[8:]), (x[:4], y[:4])]
    want = [torch.zeros_like(p) for p in params]
    for i, (xb, yb) in enumerate(halves):
        gs = torch.autograd.grad(loss_fn(params, xb, yb), params)
        want = [w + g for w, g in zip(want, gs)]
        if i == 1:
            params[2].grad = None  # e.g. module.zero_grad(): the hook copies, then re-attaches
        with grads.no_sync() if i < 2 else contextlib.nullcontext():
            loss_fn(params, xb, yb).backward()
        assert all(p.grad is v for p, v in zip(params, views))
    grads.finish()
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w)


def test_params_are_views_of_one_flat_buffer_and_the_master_at_dp1():
    cfg = config()
    params = make_params(0)
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    for zero in (0, 1, 2):
        grads, pbuf = data_parallel(params, make_table(), None, zero_stage=zero, bucket_bytes=BUCKET_BYTES)
        opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
        assert [id(p) for p in params] == ids
        assert all(isinstance(p, torch.nn.Parameter) for p in params)
        assert all(_in(p, pbuf.buffer) for p in params)
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert opt.master is pbuf.buffer  # owned space = whole buffer: no copy back
        grads.close()
        assert all(p.grad is None for p in params)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_views_are_bit_identical_to_copying(zero, optimizer, monkeypatch):
    """Gradient views + parameter buffer + aliased master give exactly what the copy path gives
    (hook copies, separate master, copy back), forced here by declaring no parameter viewable."""
    cfg = config(optimizer)
    runs = []
    for viewable in (True, False):
        if not viewable:
            monkeypatch.setattr(data, "_viewable", lambda p, device: False)
        params = make_params(0)
        grads, pbuf = data_parallel(params, make_table(), None, zero_stage=zero, bucket_bytes=BUCKET_BYTES)
        opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
        assert (pbuf.buffer is not None) == viewable
        losses, norms, _ = dp_run(params, grads, opt, cfg, steps=4, dp_rank=0, dp_size=1)
        runs.append((losses, norms, [p.detach().clone() for p in params]))
    (l1, n1, p1), (l2, n2, p2) = runs
    assert l1 == l2 and n1 == n2
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_non_fp32_parameters_fall_back_to_copying():
    cfg = config()
    params = [torch.nn.Parameter(p.detach().double()) for p in make_params(0)]
    grads, pbuf = data_parallel(params, make_table(), None, zero_stage=0, bucket_bytes=BUCKET_BYTES)
    opt = DistributedOptimizer(params, make_table(), grads, pbuf, cfg)
    assert pbuf.buffer is None and all(p.grad is None for p in params)
    from tests.distributed.dp_model import batch, loss_fn

    x, y = batch(0)
    loss_fn(params, x.double(), y.double()).backward()
    assert all(p.grad is None for p in params)  # copied into the fp32 buffer and released
    grads.finish()
    assert opt.grad_norm() > 0
    before = [p.detach().clone() for p in params]
    opt.step(cfg.lr)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_attach_modules_needs_every_parameter_and_defers_nothing_at_dp1():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    from mscale.parallel.spec import ParamSpec, ParamTable

    table = ParamTable(tuple(ParamSpec(name, tuple(p.shape), None, True)
                             for name, p in model.named_parameters()))
    grads, pbuf = data_parallel(list(model.parameters()), table, None, zero_stage=1, bucket_bytes=64)
    with pytest.raises(ValueError, match="none of the modules"):
        pbuf.attach_modules([model[0]])
    pbuf.attach_modules([model])
    model(torch.ones(1, 4))  # the observing forward
    assert not pbuf.deferring  # DP size 1: the master is the parameter buffer
    grads.close()
