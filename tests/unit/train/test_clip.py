"""Adaptive gradient clipping: warm-up, the moving threshold, spikes, state."""

import json
import math

import pytest

from mscale.config.training import TrainingConfig
from mscale.train.clip import AdaptiveClipper


def test_fixed_threshold_during_warmup_and_when_off():
    c = AdaptiveClipper(1.0, warmup=3)
    off = AdaptiveClipper(1.0, adaptive=False, warmup=0)
    for _ in range(3):
        assert c.threshold() == 1.0
        c.update(0.1)
        off.update(0.1)
    assert c.threshold() == pytest.approx(0.25)  # k=2.5 × average of 0.1
    assert off.threshold() == 1.0


def test_threshold_follows_norms_but_never_exceeds_grad_clip():
    c = AdaptiveClipper(1.0, warmup=0)
    for _ in range(200):
        c.update(2.0)  # norms above the ceiling: clipped values feed the average
    assert c.threshold() == 1.0
    for _ in range(400):
        c.update(0.05)
    assert c.threshold() == pytest.approx(2.5 * 0.05, rel=1e-2)


def test_a_spike_is_clipped_and_does_not_poison_the_average():
    c = AdaptiveClipper(10.0, warmup=5, beta=0.9)
    for _ in range(50):
        c.update(0.2)
    before = c.threshold()
    c.update(1000.0)  # spike: contributes at most the threshold
    assert c.average() <= (0.2 * 0.9 + before * 0.1) * 1.001
    assert c.threshold() < 2 * before
    c.update(math.nan)  # a skipped step leaves the state alone
    c.update(math.inf)
    assert c.count == 51


def test_state_round_trips_through_json():
    c = AdaptiveClipper(1.0, warmup=2)
    for n in (0.3, 0.4, 0.5):
        c.update(n)
    d = AdaptiveClipper(1.0, warmup=2)
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert d.threshold() == c.threshold() and d.count == 3
    with pytest.raises(ValueError):
        d.load_state_dict({"version": 99, "ema": 0, "count": 0})


def test_from_config():
    cfg = TrainingConfig(global_batch=8, grad_clip=2.0, adaptive_clip=False)
    c = AdaptiveClipper.from_config(cfg)
    assert c.grad_clip == 2.0 and not c.adaptive
