"""No false alarms on long healthy noisy traces, with GC pauses and checkpoint stalls whether or
not the trainer flags them."""

import pytest

from mscale.watch.detect.evaluate import Job, healthy_alarms
from mscale.watch.judge import Watcher
from mscale.watch.sim import generate


@pytest.mark.parametrize("job,steps,flagged", [
    (Job(64, 2, 4), 2000, True),
    (Job(64, 2, 4), 2000, False),
    (Job(16, 2, 2, 4), 2000, False),
    (Job(1024, 8, 8), 250, False),
])
def test_healthy_traces_raise_nothing(job, steps, flagged):
    assert healthy_alarms(job, steps, seed=11, flag_pauses=flagged) == []


def test_pauses_are_recognised_from_flags_or_as_every_rank_spikes():
    kw = dict(world=64, tp=2, pp=4, ranks_per_node=8, steps=400, seed=12, gc_every=25,
              ckpt_every=100)
    for flagged, key in ((True, "flagged"), (False, "spike")):
        t = generate(**kw, flag_pauses=flagged)
        w = Watcher(t.layout)
        assert w.feed(t.window()) == []
        masked = w.summary()["masked_rows"]
        assert masked[key] >= 16 and masked["warmup"] == 5  # 16 GC steps (4 with a checkpoint)


def test_hiccups_on_single_ranks_are_not_stragglers():
    t = generate(64, tp=2, pp=4, ranks_per_node=8, steps=500, seed=13, hiccup_rate=0.01)
    assert Watcher(t.layout).feed(t.window()) == []
