"""The data part of a run's start line (train/announce.py): the sources, their shares of the
blend, the held-out part."""

from __future__ import annotations

from mscale.config.training import DataConfig
from mscale.train.announce import describe_data


def test_the_start_line_says_the_sources_their_shares_and_the_held_out_part():
    blend = DataConfig(sources=[{"path": "src_a"}, {"path": "src_b", "weight": 3}],
                       eval_fraction=0.05)
    assert describe_data(blend) == "data: blend of 2 sources: src_a 25%, src_b 75%; held-out 5% of each"
    assert describe_data(DataConfig(path="t.bin")) == "data: t.bin; no held-out split"
    assert describe_data(DataConfig(path="a", eval_sources=[{"path": "h"}])) == \
        "data: a; held-out: h"
    assert describe_data(DataConfig()).startswith("data: synthetic")


def test_a_small_share_is_never_shown_as_0_nor_a_large_one_as_100():
    """A weight of 1 beside 1,000,000 read "dA 100%, dB 0%": as if dB were not read at all."""
    blend = DataConfig(sources=[{"path": "dA", "weight": 1_000_000}, {"path": "dB", "weight": 1}])
    assert describe_data(blend) == "data: blend of 2 sources: dA >99.9%, dB <0.1%; no held-out split"
    blend = DataConfig(sources=[{"path": "a", "weight": 996}, {"path": "b", "weight": 4}])
    assert describe_data(blend) == "data: blend of 2 sources: a 99.6%, b 0.4%; no held-out split"
    blend = DataConfig(sources=[{"path": "a", "weight": 1}, {"path": "b", "weight": 1}])
    assert describe_data(blend) == "data: blend of 2 sources: a 50%, b 50%; no held-out split"
